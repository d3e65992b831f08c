"""Utility helpers for KV cache manipulation, TP routing, and merge/slice.

Nothing here imports vLLM at module import time: the rank helpers look vLLM
up lazily and fall back to single-process defaults outside a vLLM worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.layouts import (  # re-exported: part of the kv_utils API
    KV_LAYOUTS,
    LayerKV,
    detect_kv_layout,
    normalize_layer_kv,
)
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "KV_LAYOUTS",
    "KV_ZMQ_MAX_STAGES",
    "KV_ZMQ_MAX_TP_RANKS",
    "KV_ZMQ_PORT_OFFSET",
    "KV_ZMQ_RANK_STRIDE",
    "sender_rank_port",
    "KV_ZMQ_REPLICA_STRIDE",
    "KVTPTopology",
    "LayerKV",
    "build_rank_aware_recv_keys",
    "build_rank_aware_send_keys",
    "detect_kv_layout",
    "get_kv_connector_key",
    "get_kv_source_ranks",
    "get_kv_target_ranks",
    "get_local_tp_rank",
    "get_omni_replica_id",
    "get_tp_world_size",
    "kv_zmq_port",
    "merge_received_rank_shards",
    "normalize_layer_kv",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
    "validate_kv_tp_topology",
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

REPLICA_ID_ENV = "VLLM_OMNI_REPLICA_ID"

_LAYER_KEYS = ("key_cache", "value_cache")


@dataclass(frozen=True)
class KVTPTopology:
    """Immutable descriptor for a KV-transfer parallel mapping.

    ``local_rank`` is this worker's rank on its own side: a source rank when
    sending, a target rank when receiving.  The dataclass does not know the
    side, so it only checks ``local_rank < max(source_tp_size, target_tp_size)``;
    :func:`get_kv_target_ranks` / :func:`get_kv_source_ranks` check the exact side.
    """

    source_tp_size: int
    target_tp_size: int
    local_rank: int

    def __post_init__(self) -> None:
        for name in ("source_tp_size", "target_tp_size", "local_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"KVTPTopology.{name} must be an int, got {value!r}")
        if self.source_tp_size < 1:
            raise ConfigError(
                f"KVTPTopology.source_tp_size must be >= 1, got {self.source_tp_size}"
            )
        if self.target_tp_size < 1:
            raise ConfigError(
                f"KVTPTopology.target_tp_size must be >= 1, got {self.target_tp_size}"
            )
        bound = max(self.source_tp_size, self.target_tp_size)
        if not 0 <= self.local_rank < bound:
            raise ConfigError(
                f"KVTPTopology.local_rank must be in [0, {bound}), got {self.local_rank}"
            )

    @property
    def ratio(self) -> int:
        """Larger parallel size divided (floor) by smaller. Always >= 1."""
        big = max(self.source_tp_size, self.target_tp_size)
        return big // min(self.source_tp_size, self.target_tp_size)

    @property
    def is_heterogeneous(self) -> bool:
        """True when sender and receiver TP sizes differ."""
        return self.source_tp_size != self.target_tp_size


def validate_kv_tp_topology(topo: KVTPTopology) -> None:
    """Reject heterogeneous TP mappings that cannot be routed losslessly."""
    big = max(topo.source_tp_size, topo.target_tp_size)
    small = min(topo.source_tp_size, topo.target_tp_size)
    if big % small != 0:
        raise ConfigError(
            f"KV TP mapping {topo.source_tp_size}->{topo.target_tp_size} is not routable: "
            "the larger of source_tp_size/target_tp_size must be a multiple of the smaller"
        )


def _check_local_rank(topo: KVTPTopology, side_size: int, side: str) -> None:
    if topo.local_rank >= side_size:
        raise ConfigError(
            f"KVTPTopology.local_rank {topo.local_rank} is out of range for the {side} side "
            f"({side}_tp_size={side_size})"
        )


def get_kv_target_ranks(topo: KVTPTopology) -> list[int]:
    """Which remote ranks this local rank sends KV shards to (send side).

    ``local_rank`` is a source rank.  ``from_tp > to_tp``: one receiver
    ``local_rank // ratio``; ``from_tp < to_tp``: ``ratio`` consecutive receivers
    which each slice their heads; equal: the same rank.
    """
    validate_kv_tp_topology(topo)
    _check_local_rank(topo, topo.source_tp_size, "source")
    r = topo.ratio
    if topo.source_tp_size >= topo.target_tp_size:
        return [topo.local_rank // r]
    return list(range(topo.local_rank * r, (topo.local_rank + 1) * r))


def get_kv_source_ranks(topo: KVTPTopology) -> list[int]:
    """Which remote ranks this local rank receives KV shards from (recv side).

    ``local_rank`` is a target rank.  ``from_tp > to_tp``: ``ratio`` consecutive
    senders, in head order; ``from_tp < to_tp``: one sender ``local_rank // ratio``.
    """
    validate_kv_tp_topology(topo)
    _check_local_rank(topo, topo.target_tp_size, "target")
    r = topo.ratio
    if topo.source_tp_size > topo.target_tp_size:
        return list(range(topo.local_rank * r, (topo.local_rank + 1) * r))
    return [topo.local_rank // r]


def _escape_key_part(text: str) -> str:
    return text.replace("%", "%25").replace("_", "%5F")


def get_kv_connector_key(
    req_id: str,
    from_stage: int | str,
    chunk_id: int,
    from_rank: int,
    to_rank: int,
) -> str:
    """Build connector key that includes rank info for KV transfers.

    Format: ``{req_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``.  Inside
    ``req_id`` and ``from_stage``, ``%`` becomes ``%25`` and ``_`` becomes ``%5F``
    so distinct tuples never share a key; ids free of ``_``/``%`` are unchanged.
    """
    for name, value in (("chunk_id", chunk_id), ("from_rank", from_rank), ("to_rank", to_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    return (
        f"{_escape_key_part(str(req_id))}_{_escape_key_part(str(from_stage))}"
        f"_{chunk_id}_{from_rank}_{to_rank}"
    )


def build_rank_aware_send_keys(
    request_id: str,
    from_stage: str,
    to_stage: str,
    topo: KVTPTopology,
    hook: Callable | None = None,
) -> list[str]:
    """Build send-side connector keys, checking injectable hook first.

    Without a hook: one key per target rank, chunk id 0, ``from_rank`` =
    ``topo.local_rank``.  ``to_stage`` is only passed on to the hook.
    """
    if hook is not None:
        return list(hook(request_id, from_stage, to_stage, topo))
    return [
        get_kv_connector_key(request_id, from_stage, 0, topo.local_rank, t)
        for t in get_kv_target_ranks(topo)
    ]


def build_rank_aware_recv_keys(
    request_id: str,
    from_stage: str,
    to_stage: str,
    topo: KVTPTopology,
    hook: Callable | None = None,
) -> list[tuple[str, int | None]]:
    """Build recv-side connector keys with sender rank info.

    Returns ``(key, from_rank)`` tuples in source-rank order; ``from_rank`` is
    None when both TP sizes are 1 (single sender, no per-rank routing needed).
    """
    if hook is not None:
        return list(hook(request_id, from_stage, to_stage, topo))
    single = topo.source_tp_size == 1 and topo.target_tp_size == 1
    return [
        (
            get_kv_connector_key(request_id, from_stage, 0, s, topo.local_rank),
            None if single else s,
        )
        for s in get_kv_source_ranks(topo)
    ]


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


def _layer_lists(payload: dict[str, Any], idx: int) -> dict[str, list[torch.Tensor | None]]:
    blocks = payload.get("layer_blocks")
    if not isinstance(blocks, dict):
        raise KVPayloadError(f"payload #{idx} has no 'layer_blocks' dict")
    out: dict[str, list[torch.Tensor | None]] = {}
    for name in _LAYER_KEYS:
        layers = blocks.get(name)
        if not isinstance(layers, list | tuple):
            raise KVPayloadError(f"payload #{idx}: layer_blocks[{name!r}] must be a list")
        out[name] = list(layers)
    return out


def _merge_layer(parts: list[torch.Tensor | None], name: str, layer: int) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise KVPayloadError(f"{name}[{layer}] is None in some shards but not in others")
    tensors = [p for p in parts if p is not None]
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() != 3:
            raise KVPayloadError(f"{name}[{layer}] of shard #{i} must be [seq, heads, dim]")
        if t.shape[0] != first.shape[0]:
            raise KVPayloadError(
                f"{name}[{layer}]: seq length {t.shape[0]} of shard #{i} != {first.shape[0]}"
            )
        if t.shape[2] != first.shape[2] or t.dtype != first.dtype:
            raise KVPayloadError(f"{name}[{layer}]: head_dim/dtype of shard #{i} differs")
    return torch.cat(tensors, dim=1)


def merge_received_rank_shards(
    payloads: list[dict[str, Any]],
    merger: Callable | None = None,
) -> dict[str, Any] | None:
    """Merge multiple source-rank KV shards for one target rank.

    When ``merger`` is given it is called with ``payloads`` and its result
    returned.  Otherwise shards (in source-rank order) are concatenated along
    the head dimension (dim 1); None layers stay None; ``request_id``,
    ``block_ids`` and ``metadata`` come from the first shard.  None or empty
    input gives None.
    """
    if merger is not None:
        return merger(payloads)
    if not payloads:
        return None
    for i, p in enumerate(payloads):
        if not isinstance(p, dict):
            raise KVPayloadError(f"shard #{i} is {type(p).__name__}, expected a KV payload dict")
    if len(payloads) == 1:
        return payloads[0]
    lists = [_layer_lists(p, i) for i, p in enumerate(payloads)]
    merged: dict[str, list[torch.Tensor | None]] = {}
    for name in _LAYER_KEYS:
        n_layers = len(lists[0][name])
        for i, layers in enumerate(lists):
            if len(layers[name]) != n_layers:
                raise KVPayloadError(
                    f"shard #{i} has {len(layers[name])} {name} layers, shard #0 has {n_layers}"
                )
        merged[name] = [
            _merge_layer([layers[name][k] for layers in lists], name, k) for k in range(n_layers)
        ]
    first = payloads[0]
    result = dict(first)
    result["layer_blocks"] = {**first["layer_blocks"], **merged}
    if isinstance(first.get("metadata"), dict):
        result["metadata"] = dict(first["metadata"])
    return result


def _check_slice_args(offset_in_shard: int, num_slices: int) -> None:
    if num_slices < 1:
        raise ConfigError(f"num_slices must be >= 1, got {num_slices}")
    if not 0 <= offset_in_shard < num_slices:
        raise ConfigError(f"offset_in_shard must be in [0, {num_slices}), got {offset_in_shard}")


def slice_kv_tensor_heads(
    tensor: torch.Tensor | None,
    offset_in_shard: int,
    num_slices: int,
) -> torch.Tensor | None:
    """Slice one KV tensor along its head dimension (dim 1).

    Returns slice ``offset_in_shard`` of ``num_slices`` equal parts as a view
    (no copy); None stays None.
    """
    _check_slice_args(offset_in_shard, num_slices)
    if tensor is None:
        return None
    if tensor.dim() < 2:
        raise KVPayloadError(f"cannot slice heads of a {tensor.dim()}-D tensor")
    heads = tensor.shape[1]
    if heads % num_slices != 0:
        raise KVPayloadError(f"{heads} heads cannot be split into {num_slices} equal slices")
    width = heads // num_slices
    return tensor.narrow(1, offset_in_shard * width, width)


def slice_layer_blocks(
    layer_blocks: dict[str, Any],
    offset_in_shard: int,
    num_slices: int,
) -> dict[str, list[torch.Tensor | None]]:
    """Slice all KV layers for one logical receiver rank."""
    out: dict[str, list[torch.Tensor | None]] = {}
    for name in _LAYER_KEYS:
        layers = layer_blocks.get(name)
        if not isinstance(layers, list | tuple):
            raise KVPayloadError(f"layer_blocks[{name!r}] must be a list")
        out[name] = [slice_kv_tensor_heads(t, offset_in_shard, num_slices) for t in layers]
    return out


def slice_received_rank_shard(
    payload: dict[str, Any] | None,
    topo: KVTPTopology,
    slicer: Callable | None = None,
) -> dict[str, Any] | None:
    """Optionally slice a received payload to extract this rank's portion.

    Used when to_tp > from_tp: the sender sent full heads and receiver rank
    ``local_rank`` keeps slice ``local_rank % ratio``.  Otherwise the payload
    is returned unchanged.  ``slicer(payload, topo)`` replaces the default.
    """
    if payload is None:
        return None
    if slicer is not None:
        return slicer(payload, topo)
    if topo.target_tp_size <= topo.source_tp_size:
        return payload
    validate_kv_tp_topology(topo)
    _check_local_rank(topo, topo.target_tp_size, "target")
    blocks = payload.get("layer_blocks")
    if not isinstance(blocks, dict):
        raise KVPayloadError("payload has no 'layer_blocks' dict")
    result = dict(payload)
    result["layer_blocks"] = {
        **blocks,
        **slice_layer_blocks(blocks, topo.local_rank % topo.ratio, topo.ratio),
    }
    return result


def _vllm_parallel_state() -> Any | None:
    # vLLM's TP group can only exist if vLLM's parallel_state was imported.
    if sys.modules.get("vllm.distributed.parallel_state") is None:
        return None
    try:
        from vllm.distributed import parallel_state
    except ImportError:  # pragma: no cover - partially importable vLLM
        return None
    if getattr(parallel_state, "_TP", None) is None:
        return None
    return parallel_state


def get_local_tp_rank() -> int:
    """Return the TP-local rank of this worker process (0 outside vLLM TP).

    Uses get_tensor_model_parallel_rank() which returns the rank within the TP
    group only, not the stage-global rank.
    """
    ps = _vllm_parallel_state()
    if ps is None:
        return 0
    try:
        return int(ps.get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError, RuntimeError):
        return 0


def get_tp_world_size() -> int:
    """Return the TP world size (tensor-parallel dimension only; 1 outside vLLM TP).

    Uses get_tensor_model_parallel_world_size() so that cfg_parallel, SP, PP
    etc. are not included in the count.
    """
    ps = _vllm_parallel_state()
    if ps is None:
        return 1
    try:
        return int(ps.get_tensor_model_parallel_world_size())
    except (AssertionError, AttributeError, RuntimeError):
        return 1


def get_omni_replica_id() -> int:
    """Return the Omni replica id: env ``VLLM_OMNI_REPLICA_ID`` or 0.

    Raises ConfigError when the variable is set but not an int >= 0.
    """
    raw = os.environ.get(REPLICA_ID_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{REPLICA_ID_ENV} must be an int, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{REPLICA_ID_ENV} must be >= 0, got {value}")
    return value
