"""Block-format KV payloads: a request's whole paged blocks, copied byte for byte.

When producer and consumer run the same attention backend (same layout, dtype,
block size and head shard), exchanging raw blocks is the cheapest move: one
memcpy per block on each side, no per-token transposition (vLLM's CPU kernel
stores K transposed inside a block). Consumers that need ``[seq, heads, dim]``
(a diffusion stage) convert with :func:`blocks_to_tokens`, which
``OmniKVTransferManager`` does on receive.

Payload: ``layer_blocks = {"kv_blocks": [raw per layer, None for skipped layers]}``
where ``raw`` is the layer's cache restricted to the request's blocks, in the
layer's own layout (cpu ``[n, h, bs, 2d]``, flash ``[2, n, bs, h, d]``, flashinfer
``[n, 2, bs, h, d]``); ``metadata`` carries ``format="raw_blocks"``, ``kv_layout`` (or, as the vLLM
connector writes it, a per-layer ``layouts`` list), ``block_size`` and ``num_tokens``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.transfer.blocks import gather_request_kv
from vllm_omni_kv.transfer.codec import PACK_STEP, LazyTensor
from vllm_omni_kv.transfer.kv_utils import detect_kv_layout, normalize_layer_kv
from vllm_omni_kv.transfer.payload import KVCacheTransferData
from vllm_omni_kv.transfer.stream import PayloadStream

BLOCK_DIM = {"cpu": 0, "flashinfer": 0, "flash": 1}
FORMAT_BLOCKS = "raw_blocks"


def _block_dim(layout: str) -> int:
    if layout not in BLOCK_DIM:
        raise ConfigError(
            f"block-format payloads need a single-tensor KV layout ({', '.join(BLOCK_DIM)}); "
            f"got {layout!r}: use the token format instead"
        )
    return BLOCK_DIM[layout]


#: gathers report progress about this often, so the packer hashes bytes still in cache
STEP_BYTES = PACK_STEP


def _memmove_ok(cache: torch.Tensor, other: torch.Tensor, dim: int) -> bool:
    return (
        dim == 0
        and cache.device.type == "cpu"
        and other.device.type == "cpu"
        and cache.is_contiguous()
        and other.is_contiguous()
        and cache.dtype == other.dtype
    )


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset in ids, first block id, length)`` of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for off, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            o, first, n = runs[-1]
            runs[-1] = (o, first, n + 1)
        else:
            runs.append((off, b, 1))
    return runs


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # index_select/index_copy_ have no CPU kernels for fp8: same-size ints move the same bytes
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def iter_gather_blocks(
    cache: torch.Tensor, layout: str, ids: Sequence[int], out: torch.Tensor
) -> Iterator[int]:
    """Copy blocks ``ids`` of ``cache`` into ``out``, yielding the bytes of ``out`` written so far.

    On CPU every run of consecutive blocks is one ``memmove`` (split into
    ``STEP_BYTES`` steps), so a caller can checksum each step while it is in cache.
    """
    dim = _block_dim(layout)
    if _memmove_ok(cache, out, dim):
        per = cache[0].numel() * cache.element_size()
        step = max(1, STEP_BYTES // per)
        base, dst = cache.data_ptr(), out.data_ptr()
        reported = 0
        for off, first, n in block_runs(ids):
            for j in range(0, n, step):
                k = min(step, n - j)
                ctypes.memmove(dst + (off + j) * per, base + (first + j) * per, k * per)
                if off + j + k - reported >= step:  # report about every STEP_BYTES
                    reported = off + j + k
                    yield reported * per
        if reported < len(ids):
            yield len(ids) * per
        return
    idx = torch.tensor(list(ids), dtype=torch.long, device=cache.device)
    if out.device == cache.device:
        torch.index_select(_as_bytes(cache), dim, idx, out=_as_bytes(out))
    else:  # e.g. a GPU cache packed into a host buffer
        out.copy_(torch.index_select(cache, dim, idx))
    yield out.numel() * out.element_size()


def gather_blocks(cache: torch.Tensor, layout: str, ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy blocks ``ids`` of ``cache`` into ``out`` (their raw layout, block dim first/second)."""
    for _ in iter_gather_blocks(cache, layout, ids, out):
        pass


def scatter_blocks(cache: torch.Tensor, layout: str, ids: Sequence[int], src: torch.Tensor) -> None:
    """Write raw blocks ``src`` into blocks ``ids`` of ``cache`` (one memmove per run on CPU)."""
    dim = _block_dim(layout)
    if _memmove_ok(cache, src, dim):
        per = cache[0].numel() * cache.element_size()
        base, s = cache.data_ptr(), src.data_ptr()
        for off, first, n in block_runs(ids):
            ctypes.memmove(base + first * per, s + off * per, n * per)
        return
    idx = torch.tensor(list(ids), dtype=torch.long, device=cache.device)
    _as_bytes(cache).index_copy_(dim, idx, _as_bytes(src.to(cache.device)))


def _layout_of(layer: torch.Tensor, layout: str | None) -> str:
    found = layout or detect_kv_layout(layer)
    _block_dim(found)
    return found


def extract_request_blocks(
    request_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    kv_caches: Sequence[torch.Tensor | None],
    *,
    layout: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> KVCacheTransferData:
    """A block-format payload of the blocks holding ``num_tokens`` tokens (lazy: one copy at pack time)."""
    first = next((c for c in kv_caches if c is not None), None)
    if first is None:
        raise KVPayloadError(f"request {request_id}: no layer has a KV cache")
    lay = _layout_of(first, layout)
    dim = BLOCK_DIM[lay]
    bs = int(first.shape[2])  # the block-size axis is dim 2 in every supported layout
    needed = -(-int(num_tokens) // bs)
    ids = [int(b) for b in block_ids][:needed]
    if needed <= 0 or len(ids) < needed:
        raise KVPayloadError(
            f"request {request_id}: {num_tokens} tokens need {needed} blocks of {bs}, got {len(block_ids)}"
        )
    nblocks = int(first.shape[dim])
    if min(ids) < 0 or max(ids) >= nblocks:
        raise KVPayloadError(f"request {request_id}: block id out of range [0, {nblocks})")
    layers: list[Any] = []
    for cache in kv_caches:
        if cache is None:
            layers.append(None)
            continue
        shape = list(cache.shape)
        shape[dim] = needed

        def fill(dst: torch.Tensor, cache: torch.Tensor = cache) -> Iterator[int]:
            return iter_gather_blocks(cache, lay, ids, dst)

        layers.append(LazyTensor(tuple(shape), cache.dtype, fill, cache.device))
    meta = {
        **(metadata or {}),
        "format": FORMAT_BLOCKS,
        "kv_layout": lay,
        "block_size": bs,
        "num_tokens": int(num_tokens),
        "num_layers": len(layers),
    }
    return KVCacheTransferData(request_id, {"kv_blocks": layers}, ids, meta)


def is_block_payload(data: dict[str, Any] | None) -> bool:
    return bool(data) and (data.get("metadata") or {}).get("format") == FORMAT_BLOCKS  # type: ignore[union-attr]


def _check_block_payload(data: dict[str, Any]) -> tuple[list[Any], str, int, int]:
    meta = data.get("metadata") or {}
    layers = (data.get("layer_blocks") or {}).get("kv_blocks")
    lay = meta.get("kv_layout") or next(iter(meta.get("layouts") or []), None)
    bs, n = meta.get("block_size"), meta.get("num_tokens")
    if not isinstance(layers, list) or lay not in BLOCK_DIM:
        raise KVPayloadError("block-format payload lacks kv_blocks or a known kv_layout")
    if not (isinstance(bs, int) and bs > 0 and isinstance(n, int) and n >= 0):
        raise KVPayloadError("block-format payload lacks block_size/num_tokens")
    return layers, str(lay), bs, n


def plan_block_injection(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    layout: str | None = None,
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor, str, list[int]]]]:
    """Check a block-format payload against the local cache (header only, no bytes read).

    Returns its token count and ``(source, cache, layout, local block ids)`` per
    layer to write. Raises ``KVPayloadError`` when the payload's layout, dtype or
    block shape differs from the local cache (then use the token format).
    """
    layers, lay, bs, n = _check_block_payload(data)
    if len(layers) != len(kv_caches):
        raise KVPayloadError(
            f"payload has {len(layers)} layers, the local model has {len(kv_caches)}"
        )
    dim = BLOCK_DIM[lay]
    needed = -(-n // bs)
    ids = [int(b) for b in block_ids][:needed]
    if len(ids) < needed:
        raise KVPayloadError(f"{n} tokens need {needed} local blocks, {len(block_ids)} given")
    plan = []
    for i, (src, cache) in enumerate(zip(layers, kv_caches, strict=True)):
        if cache is None:
            continue
        if src is None:
            raise KVPayloadError(f"payload has no KV for layer {i}, which the local model needs")
        local = _layout_of(cache, layout)
        want = list(cache.shape)
        want[dim] = needed
        if local != lay or list(src.shape) != want or src.dtype != cache.dtype:
            raise KVPayloadError(
                f"layer {i}: payload blocks {lay} {tuple(src.shape)} {src.dtype} do not fit the local "
                f"cache {local} {tuple(want)} {cache.dtype} (same backend, dtype, block size and TP?)"
            )
        plan.append((src, cache, lay, ids))
    return n, plan


def inject_request_blocks(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    layout: str | None = None,
) -> int:
    """Write a block-format payload into the consumer's blocks ``block_ids``; return its token count.

    Raises ``KVPayloadError`` when the payload does not fit the local cache (see
    :func:`plan_block_injection`).
    """
    n, plan = plan_block_injection(data, kv_caches, block_ids, layout=layout)
    for src, cache, lay, ids in plan:
        scatter_blocks(cache, lay, ids, src)
    return n


def inject_streamed_blocks(
    stream: PayloadStream,
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    deadline: float,
    *,
    layout: str | None = None,
) -> int:
    """Like :func:`inject_request_blocks` for a payload still arriving: each block is
    written as soon as its bytes are final. The checksum is compared after the
    last block; on any error the blocks may hold part of the payload."""
    n, plan = plan_block_injection(stream.obj, kv_caches, block_ids, layout=layout)
    tasks = _scatter_tasks(plan, stream.frame_address)
    i = 0
    for ready in stream.ready(deadline):
        while i < len(tasks) and tasks[i][0] <= ready:
            _end, dst, src_ptr, nbytes, fallback = tasks[i]
            if fallback is not None:
                fallback()
            else:
                ctypes.memmove(dst, src_ptr, nbytes)
            i += 1
    if i < len(tasks):
        raise KVPayloadError(f"the stream ended with {len(tasks) - i} blocks not written")
    return n


_Task = tuple[int, int, int, int, Callable[[], None] | None]


def _scatter_tasks(
    plan: list[tuple[torch.Tensor, torch.Tensor, str, list[int]]], frame_address: int | None
) -> list[_Task]:
    """``(frame end offset, dst, src, nbytes, fallback)`` per copy, in frame order.

    Runs of consecutive local blocks are merged up to ``STEP_BYTES`` so each copy
    starts as soon as its bytes are final. Layers that cannot be memmoved are one
    ``scatter_blocks`` call once the whole layer is final.
    """
    tasks: list[_Task] = []
    for src, cache, lay, ids in plan:
        start = 0 if frame_address is None else src.data_ptr() - frame_address
        size = src.numel() * src.element_size()
        if frame_address is None or not _memmove_ok(cache, src, _block_dim(lay)):
            tasks.append(
                (start + size, 0, 0, 0, functools.partial(scatter_blocks, cache, lay, ids, src))
            )
            continue
        per = cache[0].numel() * cache.element_size()
        limit = max(1, STEP_BYTES // per)
        base, s = cache.data_ptr(), src.data_ptr()
        for off, first, n in block_runs(ids):
            for j in range(0, n, limit):
                k = min(limit, n - j)
                end = start + (off + j + k) * per
                tasks.append((end, base + (first + j) * per, s + (off + j) * per, k * per, None))
    tasks.sort(key=lambda t: t[0])
    return tasks


def blocks_to_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """Convert a block-format payload to the token format (``[seq, heads, dim]`` per layer)."""
    layers, lay, _bs, n = _check_block_payload(data)
    keys: list[Any] = []
    values: list[Any] = []
    for i, raw in enumerate(layers):
        if raw is None:
            keys.append(None)
            values.append(None)
            continue
        kv = normalize_layer_kv(raw, req_id=str(data.get("request_id")), layer_idx=i, layout=lay)
        if kv is None:
            raise KVPayloadError(f"layer {i}: block payload does not match layout {lay}")
        ids = list(range(int(kv[0].shape[0])))
        keys.append(gather_request_kv(kv[0], ids, n))
        values.append(gather_request_kv(kv[1], ids, n))
    meta = {**(data.get("metadata") or {}), "format": "tokens", "seq_len": n}
    return {
        "request_id": data.get("request_id"),
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": data.get("block_ids", []),
        "metadata": meta,
    }
