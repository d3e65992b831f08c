"""Head-dimension shards of a token-major KV payload: merge per source rank, slice per target.

A payload is a dict with ``layer_blocks = {"key_cache": [...], "value_cache": [...]}`` of
``[seq, heads, dim]`` tensors (or None per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.tp_routing import (
    KVTPTopology,
    check_local_rank,
    validate_kv_tp_topology,
)

__all__ = [
    "merge_received_rank_shards",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
]

_LAYER_KEYS = ("key_cache", "value_cache")


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
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
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
    check_local_rank(topo, topo.target_tp_size, "target")
    blocks = payload.get("layer_blocks")
    if not isinstance(blocks, dict):
        raise KVPayloadError("payload has no 'layer_blocks' dict")
    result = dict(payload)
    result["layer_blocks"] = {
        **blocks,
        **slice_layer_blocks(blocks, topo.local_rank % topo.ratio, topo.ratio),
    }
    return result
