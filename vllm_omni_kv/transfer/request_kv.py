"""Received KV on vllm-omni request objects (the legacy interface): ``past_key_values``,
``kv_metadata`` and the CFG companions' extras."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

__all__ = ["attach_extras", "attach_kv", "cfg_request_ids"]


def attach_kv(req: Any, data: dict[str, Any]) -> None:
    """Attach received KV to ``req``.

    Sets ``req.past_key_values`` (with ``key_cache``/``value_cache`` lists of
    ``[seq, heads, dim]`` tensors) and ``req.kv_metadata``; mirrors both onto
    ``req.sampling_params`` when the request has one.
    """
    blocks = data.get("layer_blocks", {})
    pkv = SimpleNamespace(
        key_cache=blocks.get("key_cache", []),
        value_cache=blocks.get("value_cache", []),
        request_id=data.get("request_id"),
        block_ids=data.get("block_ids", []),
    )
    meta = data.get("metadata", {})
    for target in (req, getattr(req, "sampling_params", None)):
        if target is None:
            continue
        target.past_key_values = pkv
        target.kv_metadata = meta


def cfg_request_ids(req: Any) -> list[str] | None:
    """The request ids of ``req``'s CFG companions (``cfg_kv_request_ids`` on the request
    or its ``sampling_params``); None without any."""
    for src in (req, getattr(req, "sampling_params", None)):
        ids = getattr(src, "cfg_kv_request_ids", None) if src is not None else None
        if ids:
            return [str(i) for i in ids]
    return None


def attach_extras(req: Any, extras: dict[str, Any]) -> None:
    """Set each of ``extras`` as an attribute of ``req.sampling_params`` (else of ``req``)."""
    target = getattr(req, "sampling_params", None) or req
    for k, v in extras.items():
        setattr(target, k, v)
