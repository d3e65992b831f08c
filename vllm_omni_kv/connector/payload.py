"""Connector payloads: build one request's frame contents from the paged cache, and
validate + inject a received one.

Two formats travel: ``raw_blocks`` (each layer's blocks exactly as the cache holds
them, one memcpy per run of consecutive blocks; needs the same backend and TP on
both sides) and ``token_major`` (``[rows, heads, dim]`` K and V per layer, for
heterogeneous TP). Both are built from :class:`codec.LazyTensor` so the bytes are
gathered straight into the transport buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.connector.metadata import LoadSpec, SaveSpec
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.transfer import codec
from vllm_omni_kv.transfer.blocks import gather_request_kv, scatter_request_kv
from vllm_omni_kv.transfer.raw_blocks import iter_gather_blocks, scatter_blocks


@dataclass
class LayerCache:
    """One attention layer's paged cache, normalised."""

    name: str
    key: torch.Tensor  # [num_blocks, block_size, heads, dim] view of the paged cache
    value: torch.Tensor
    raw: torch.Tensor | None  # the cache tensor itself, when one tensor holds K and V
    block_dim: int  # its block dimension
    layout: str


def _fill(blocks: torch.Tensor, ids: torch.Tensor, n: int, dst: torch.Tensor) -> None:
    gather_request_kv(blocks, ids, n, out=dst)


def _fill_raw(layer: LayerCache, ids: list[int], dst: torch.Tensor) -> Iterator[int]:
    assert layer.raw is not None
    return iter_gather_blocks(layer.raw, layer.layout, ids, dst)


def build_payload(
    layers: list[LayerCache], spec: SaveSpec, block_size: int, md: dict[str, Any], raw: bool
) -> dict[str, Any]:
    """One request's payload: raw blocks (``raw``) or token-major K/V, both lazy (one copy at pack time)."""
    # Whole blocks, tail block included: the bytes inside a block are copied as they
    # are, whatever order the attention kernel keeps them in (CPU kernels pack them).
    n = len(spec.block_ids) * block_size
    ids = torch.tensor(spec.block_ids, dtype=torch.long)
    if raw:
        # Fast path: each layer's blocks as the cache holds them (K and V together),
        # one contiguous memcpy per block on each side.
        raw_layers: list[Any] = []
        for layer in layers:
            assert layer.raw is not None
            raw_shape = list(layer.raw.shape)
            raw_shape[layer.block_dim] = len(spec.block_ids)
            raw_layers.append(
                codec.LazyTensor(
                    tuple(raw_shape),
                    layer.raw.dtype,
                    functools.partial(_fill_raw, layer, list(spec.block_ids)),
                )
            )
        md["format"] = "raw_blocks"
        md["layouts"] = [layer.layout for layer in layers]
        return {
            "request_id": spec.transfer_id,
            "layer_blocks": {"kv_blocks": raw_layers},
            "block_ids": list(spec.block_ids),
            "metadata": md,
        }
    keys: list[Any] = []
    values: list[Any] = []
    for layer in layers:
        shape = (n, int(layer.key.shape[2]), int(layer.key.shape[3]))
        keys.append(
            codec.LazyTensor(shape, layer.key.dtype, functools.partial(_fill, layer.key, ids, n))
        )
        values.append(
            codec.LazyTensor(
                shape, layer.value.dtype, functools.partial(_fill, layer.value, ids, n)
            )
        )
    md["format"] = "token_major"
    return {
        "request_id": spec.transfer_id,
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": list(spec.block_ids),
        "metadata": md,
    }


def inject_payload(
    layers: list[LayerCache], block_size: int, spec: LoadSpec, payload: dict[str, Any]
) -> None:
    """Validate a received payload against the local cache and write it into ``spec``'s blocks."""
    md = payload.get("metadata")
    if not isinstance(md, dict):
        raise KVPayloadError("payload has no metadata mapping")
    if md.get("prompt_digest") != spec.prompt_digest:
        raise KVPayloadError(
            "payload was produced for a different prompt (token digest mismatch): send the "
            "consumer exactly the prompt the producer prefilled"
        )
    n = md.get("num_tokens")
    if n != spec.num_prompt_tokens:
        raise KVPayloadError(
            f"payload holds {n} tokens, the consumer's prompt has {spec.num_prompt_tokens}"
        )
    start = spec.num_local_tokens
    end = start + spec.num_load_tokens
    if start % block_size or end > spec.num_prompt_tokens:
        raise KVPayloadError(f"cannot load tokens [{start}, {end}) of {n}")
    rows = -(-spec.num_prompt_tokens // block_size) * block_size
    if md.get("rows") != rows:
        raise KVPayloadError(
            f"payload holds {md.get('rows')} token slots, expected {rows} (whole blocks of "
            f"{block_size}): producer and consumer must use the same block_size"
        )
    blocks = payload.get("layer_blocks")
    if not isinstance(blocks, dict):
        raise KVPayloadError("payload has no layer_blocks mapping")
    first = start // block_size
    if md.get("format") == "raw_blocks":
        _inject_raw(layers, spec, md, blocks, first, rows // block_size)
        return
    ks, vs = blocks.get("key_cache"), blocks.get("value_cache")
    if not isinstance(ks, list) or not isinstance(vs, list):
        raise KVPayloadError("payload layer_blocks lack key_cache/value_cache lists")
    if len(ks) != len(layers) or len(vs) != len(layers):
        raise KVPayloadError(
            f"payload has {len(ks)}/{len(vs)} K/V layers, this model has {len(layers)}: "
            "producer and consumer must serve the same model"
        )
    for i, layer in enumerate(layers):
        want = (rows, int(layer.key.shape[2]), int(layer.key.shape[3]))
        for name, t in (("key", ks[i]), ("value", vs[i])):
            if not isinstance(t, torch.Tensor):
                raise KVPayloadError(f"layer {i} {name} is missing from the payload")
            if tuple(t.shape) != want or t.dtype != layer.key.dtype:
                raise KVPayloadError(
                    f"layer {i} {name}: payload {tuple(t.shape)} {t.dtype}, expected {want} "
                    f"{layer.key.dtype} (same model, dtype and TP mapping on both sides?)"
                )
    ids = spec.block_ids[first:]
    for i, layer in enumerate(layers):
        scatter_request_kv(layer.key, ids, ks[i][start:rows])
        scatter_request_kv(layer.value, ids, vs[i][start:rows])


def _inject_raw(
    layers: list[LayerCache],
    spec: LoadSpec,
    md: dict[str, Any],
    blocks: dict[str, Any],
    first: int,
    n_blocks: int,
) -> None:
    got_layers = blocks.get("kv_blocks")
    if not isinstance(got_layers, list) or len(got_layers) != len(layers):
        raise KVPayloadError(
            f"raw payload has {len(got_layers) if isinstance(got_layers, list) else 'no'} layers, "
            f"this model has {len(layers)}: producer and consumer must serve the same model"
        )
    if md.get("layouts") != [x.layout for x in layers]:
        raise KVPayloadError(
            f"producer KV layout {md.get('layouts')} differs from this engine's; both "
            "stages need the same attention backend for raw block transfer"
        )
    ids = spec.block_ids[first:n_blocks]
    if len(ids) != n_blocks - first:
        raise KVPayloadError(f"{len(spec.block_ids)} local blocks cannot hold {n_blocks}")
    for i, layer in enumerate(layers):
        t = got_layers[i]
        assert layer.raw is not None
        want = list(layer.raw.shape)
        want[layer.block_dim] = n_blocks
        if not isinstance(t, torch.Tensor) or list(t.shape) != want or t.dtype != layer.raw.dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise KVPayloadError(
                f"layer {i}: payload blocks {got}, expected {tuple(want)} {layer.raw.dtype}"
            )
    for i, layer in enumerate(layers):
        assert layer.raw is not None
        src = got_layers[i].narrow(layer.block_dim, first, len(ids))
        scatter_blocks(layer.raw, layer.layout, ids, src)  # one memmove per run of blocks
