"""Rank-aware connector keys: one key per (sender rank, receiver rank) of a request."""

from __future__ import annotations

from collections.abc import Callable

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.tp_routing import (
    KVTPTopology,
    get_kv_source_ranks,
    get_kv_target_ranks,
)

__all__ = ["build_rank_aware_recv_keys", "build_rank_aware_send_keys", "get_kv_connector_key"]


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
