"""KV-transfer TP topology: which sender ranks feed which receiver ranks."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni_kv.errors import ConfigError

__all__ = [
    "KVTPTopology",
    "check_local_rank",
    "get_kv_source_ranks",
    "get_kv_target_ranks",
    "validate_kv_tp_topology",
]


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


def check_local_rank(topo: KVTPTopology, side_size: int, side: str) -> None:
    """Raise ConfigError unless ``topo.local_rank`` is a rank of the ``side`` side."""
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
    check_local_rank(topo, topo.source_tp_size, "source")
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
    check_local_rank(topo, topo.target_tp_size, "target")
    r = topo.ratio
    if topo.source_tp_size > topo.target_tp_size:
        return list(range(topo.local_rank * r, (topo.local_rank + 1) * r))
    return [topo.local_rank // r]
