"""The KV side channel's port rule: stage, TP rank and replica -> TCP port."""

from __future__ import annotations

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.worker_ranks import get_omni_replica_id

__all__ = [
    "KV_ZMQ_MAX_STAGES",
    "KV_ZMQ_MAX_TP_RANKS",
    "KV_ZMQ_PORT_OFFSET",
    "KV_ZMQ_RANK_STRIDE",
    "KV_ZMQ_REPLICA_STRIDE",
    "kv_zmq_port",
    "sender_rank_port",
]

#: Port offset of the KV ZMQ side channel above a stage's base port.
KV_ZMQ_PORT_OFFSET = 100
#: Stage ids must lie in ``[0, KV_ZMQ_MAX_STAGES)``; also the per-rank port stride.
KV_ZMQ_MAX_STAGES = 16
#: TP ranks must lie in ``[0, KV_ZMQ_MAX_TP_RANKS)``.
KV_ZMQ_MAX_TP_RANKS = 64
#: Port stride between two consecutive TP ranks.
KV_ZMQ_RANK_STRIDE = KV_ZMQ_MAX_STAGES
#: Port stride between two consecutive Omni replicas.
KV_ZMQ_REPLICA_STRIDE = KV_ZMQ_MAX_STAGES * KV_ZMQ_MAX_TP_RANKS


def kv_zmq_port(
    base_port: int,
    from_stage: int,
    local_rank: int = 0,
    replica_id: int | None = None,
) -> int:
    """Compute the ZMQ port for a KV-transfer connector.

    ``port = base_port + KV_ZMQ_PORT_OFFSET + from_stage
    + local_rank * KV_ZMQ_RANK_STRIDE + replica_id * KV_ZMQ_REPLICA_STRIDE``
    (strides 16 and 1024).  Replica 0 / rank 0 gives the historical
    ``base + OFFSET + stage``.  Ports are distinct for stage < 16, rank < 64;
    ``replica_id=None`` reads :func:`get_omni_replica_id`.  Raises ConfigError
    for out-of-range inputs or a result above 65535.
    """
    try:
        stage = int(from_stage)
    except (TypeError, ValueError):
        raise ConfigError(f"from_stage must be an int stage id, got {from_stage!r}") from None
    replica = get_omni_replica_id() if replica_id is None else int(replica_id)
    if base_port < 0:
        raise ConfigError(f"base_port must be >= 0, got {base_port}")
    if not 0 <= stage < KV_ZMQ_MAX_STAGES:
        raise ConfigError(f"from_stage must be in [0, {KV_ZMQ_MAX_STAGES}), got {stage}")
    if not 0 <= local_rank < KV_ZMQ_MAX_TP_RANKS:
        raise ConfigError(f"local_rank must be in [0, {KV_ZMQ_MAX_TP_RANKS}), got {local_rank}")
    if replica < 0:
        raise ConfigError(f"replica_id must be >= 0, got {replica}")
    port = (
        base_port
        + KV_ZMQ_PORT_OFFSET
        + stage
        + local_rank * KV_ZMQ_RANK_STRIDE
        + replica * KV_ZMQ_REPLICA_STRIDE
    )
    if port > 65535:
        raise ConfigError(
            f"KV ZMQ port {port} exceeds 65535 (base_port={base_port}, from_stage={stage}, "
            f"local_rank={local_rank}, replica_id={replica})"
        )
    return port


def sender_rank_port(rank0_port: int, rank: int) -> int:
    """The side-channel port of sender TP rank ``rank`` whose rank 0 listens on ``rank0_port``.

    The one rank -> port rule: senders listen on ``rank0_port + rank *
    KV_ZMQ_RANK_STRIDE`` (what :func:`kv_zmq_port` gives for consecutive ranks), and
    receivers address them the same way.
    """
    if not 0 <= rank < KV_ZMQ_MAX_TP_RANKS:
        raise ConfigError(f"sender rank must be in [0, {KV_ZMQ_MAX_TP_RANKS}), got {rank}")
    port = int(rank0_port) + int(rank) * KV_ZMQ_RANK_STRIDE
    if not 0 < port <= 65535:
        raise ConfigError(
            f"side-channel port {port} of sender rank {rank} (rank 0 on {rank0_port}) is not a "
            "valid TCP port: lower the base zmq_port"
        )
    return port
