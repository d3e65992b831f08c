"""The paged-blocks payload format: a request's whole paged blocks, copied byte for byte.

When producer and consumer run the same attention backend (same layout, dtype,
block size and head shard), exchanging raw blocks is the cheapest move: one
memcpy per run of blocks on each side, no per-token transposition (vLLM's CPU
kernel stores K transposed inside a block). ``layer_blocks["kv_blocks"]`` holds,
per layer, the cache restricted to the request's blocks in the layer's own
layout (cpu ``[n, h, bs, 2d]``, flash ``[2, n, bs, h, d]``, flashinfer
``[n, 2, bs, h, d]``; None for a skipped layer); the metadata is
:class:`~vllm_omni_kv.kvcache.meta.PayloadMeta` with ``kv_layout``.

A receiver plans where each payload block goes (:func:`plan_block_injection`);
the plan names the frame byte spans it needs, so a consumer that already holds
the first blocks of a prompt loads only the rest (:meth:`BlocksPlan.apply`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.blocks import gather_request_kv
from vllm_omni_kv.kvcache.kv_utils import detect_kv_layout, normalize_layer_kv
from vllm_omni_kv.kvcache.meta import PAGED_BLOCKS, TOKEN_MAJOR, PayloadMeta
from vllm_omni_kv.wire.codec import PACK_STEP, LazyTensor
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import CopyOut, PayloadStream, Span

BLOCK_DIM = {"cpu": 0, "flashinfer": 0, "flash": 1}
KV_BLOCKS = "kv_blocks"
#: gathers report progress about this often, so the packer hashes bytes still in cache
STEP_BYTES = PACK_STEP


def block_dim(layout: str) -> int:
    """The block dimension of a single-tensor cache layout."""
    if layout not in BLOCK_DIM:
        raise ConfigError(
            f"paged-blocks payloads need a single-tensor KV layout ({', '.join(BLOCK_DIM)}); "
            f"got {layout!r}: use the token-major format instead"
        )
    return BLOCK_DIM[layout]


def block_bytes(cache: torch.Tensor, layout: str) -> int:
    """Bytes of one block in one contiguous run of ``cache`` (per K/V half for flash)."""
    dim = block_dim(layout)
    return math.prod(cache.shape[dim + 1 :]) * cache.element_size()


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
    dim = block_dim(layout)
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


def scatter_blocks(cache: torch.Tensor, layout: str, ids: Sequence[int], src: torch.Tensor) -> None:
    """Write raw blocks ``src`` into blocks ``ids`` of ``cache`` (one memmove per run on CPU)."""
    dim = block_dim(layout)
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
    block_dim(found)
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
    """A paged-blocks payload of the blocks holding ``num_tokens`` tokens (lazy: one copy at pack time)."""
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
            f"request {request_id}: {num_tokens} tokens need {needed} blocks of {bs}, "
            f"got {len(block_ids)}"
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
        fill = functools.partial(iter_gather_blocks, cache, lay, ids)
        layers.append(LazyTensor(tuple(shape), cache.dtype, fill, cache.device))
    meta = PayloadMeta(PAGED_BLOCKS, int(num_tokens), bs, needed * bs, len(layers), lay)
    return KVCacheTransferData(
        request_id, {KV_BLOCKS: layers}, ids, meta.to_dict(**(metadata or {}))
    )


def is_block_payload(data: dict[str, Any] | None) -> bool:
    md = data.get("metadata") if isinstance(data, dict) else None
    return isinstance(md, dict) and md.get("format") == PAGED_BLOCKS


def _block_layers(data: dict[str, Any]) -> tuple[PayloadMeta, list[Any]]:
    meta = PayloadMeta.of(data)
    layers = (data.get("layer_blocks") or {}).get(KV_BLOCKS)
    if meta.format != PAGED_BLOCKS or not isinstance(layers, list):
        raise KVPayloadError("not a paged-blocks payload (no kv_blocks list)")
    assert meta.kv_layout is not None
    block_dim(meta.kv_layout)
    return meta, layers


def _view_spans(view: torch.Tensor, dim: int, frame_address: int) -> list[Span]:
    """Frame byte spans of ``view``, a slice along ``dim`` of a contiguous payload tensor."""
    per = math.prod(view.shape[dim:]) * view.element_size()
    spans = []
    for index in itertools.product(*(range(n) for n in view.shape[:dim])):
        start = view[index].data_ptr() - frame_address if index else view.data_ptr() - frame_address
        spans.append((start, start + per))
    return spans


def merge_spans(spans: Sequence[Span]) -> list[Span]:
    """Sorted spans with touching or overlapping ones merged."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass
class _Copy:
    src: torch.Tensor  # the payload blocks to write (a view of the frame)
    cache: torch.Tensor
    layout: str
    ids: list[int]  # local block ids, one per payload block of ``src``


#: (frame end offset, dst address, src address, nbytes, dst view, fallback)
_Task = tuple[int, int, int, int, memoryview | None, Callable[[], None] | None]


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return _as_bytes(t).view(torch.uint8).reshape(-1).numpy().data.cast("B")


class BlocksPlan:
    """Where each payload block goes; built by :func:`plan_block_injection`."""

    def __init__(self, tokens: int, copies: list[_Copy]) -> None:
        self.tokens = tokens
        self.copies = copies

    def spans(self, frame_address: int | None) -> list[Span] | None:
        """The frame bytes the plan reads (None: the whole frame, when not one local frame)."""
        if frame_address is None:
            return None
        spans: list[Span] = []
        for c in self.copies:
            spans += _view_spans(c.src, block_dim(c.layout), frame_address)
        return merge_spans(spans)

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        """Write the planned blocks as their bytes arrive; return the payload's token count.

        Host caches take one ``copy_into`` (each chunk verified in the cache right
        after its copy); other caches are written layer by layer as bytes are final.
        On any error the local blocks may hold part of the payload: do not use them.
        """
        base = stream.frame_address
        tasks = self._tasks(base)
        if base is not None and all(t[5] is None for t in tasks):
            outs: list[CopyOut] = []
            for _end, dst, src, nbytes, view, _f in tasks:
                assert view is not None
                outs.append((src - base, src - base + nbytes, dst, view))
            stream.copy_into(outs, deadline, cancel)
            return self.tokens
        i = 0
        for ready in stream.load(self.spans(base), deadline, cancel):
            while i < len(tasks) and tasks[i][0] <= ready:
                _end, dst, src_ptr, nbytes, _view, fallback = tasks[i]
                if fallback is not None:
                    fallback()
                else:
                    ctypes.memmove(dst, src_ptr, nbytes)
                i += 1
        if i < len(tasks):
            raise KVPayloadError(f"the stream ended with {len(tasks) - i} block copies not done")
        return self.tokens

    def _tasks(self, frame_address: int | None) -> list[_Task]:
        """One task per copy, in frame order.

        Runs of consecutive local blocks are merged up to ``STEP_BYTES`` so each copy
        starts as soon as its bytes are final; layers that cannot be memmoved are one
        ``scatter_blocks`` call once their last needed byte is final.
        """
        tasks: list[_Task] = []
        for c in self.copies:
            dim = block_dim(c.layout)
            if frame_address is None or not _memmove_ok(c.cache, c.src, dim):
                end = 0
                if frame_address is not None:
                    end = max(b for _a, b in _view_spans(c.src, dim, frame_address))
                call = functools.partial(scatter_blocks, c.cache, c.layout, c.ids, c.src)
                tasks.append((end, 0, 0, 0, None, call))
                continue
            start = c.src.data_ptr() - frame_address
            per = c.cache[0].numel() * c.cache.element_size()
            limit = max(1, STEP_BYTES // per)
            base, s = c.cache.data_ptr(), c.src.data_ptr()
            whole = _byte_view(c.cache)
            for off, first, n in block_runs(c.ids):
                for j in range(0, n, limit):
                    k = min(limit, n - j)
                    at = (first + j) * per
                    view = whole[at : at + k * per]
                    end = start + (off + j + k) * per
                    tasks.append((end, base + at, s + (off + j) * per, k * per, view, None))
        tasks.sort(key=lambda t: t[0])
        return tasks


def plan_block_injection(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
    layout: str | None = None,
) -> BlocksPlan:
    """Check a paged-blocks payload against the local cache (header only, no bytes read).

    ``kv_caches`` are the local layers the payload (or part) covers; payload
    block ``j`` goes to local block ``block_ids[j]`` for ``j >= first_block`` (the
    blocks before it are already held locally). Raises ``KVPayloadError`` when
    the payload's layout, dtype or block shape differs from the local cache.
    """
    meta, layers = _block_layers(data)
    lay = meta.kv_layout
    assert lay is not None
    if len(layers) != len(kv_caches):
        raise KVPayloadError(
            f"payload has {len(layers)} layers, the local model has {len(kv_caches)}"
        )
    dim = BLOCK_DIM[lay]
    needed = meta.num_blocks
    ids = [int(b) for b in block_ids][:needed]
    if len(ids) < needed:
        raise KVPayloadError(
            f"{meta.rows} token slots need {needed} local blocks, {len(block_ids)} given"
        )
    if not 0 <= first_block <= needed:
        raise KVPayloadError(f"first block {first_block} is outside the payload's {needed} blocks")
    copies = []
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
                f"layer {i}: payload blocks {lay} {tuple(src.shape)} {src.dtype} do not fit the "
                f"local cache {local} {tuple(want)} {cache.dtype} (same backend, dtype, block size "
                "and TP?)"
            )
        if first_block < needed:
            view = src.narrow(dim, first_block, needed - first_block)
            copies.append(_Copy(view, cache, lay, ids[first_block:]))
    return BlocksPlan(meta.num_tokens, copies)


def inject_request_blocks(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
    layout: str | None = None,
) -> int:
    """Write a complete paged-blocks payload into blocks ``block_ids``; return its token count."""
    plan = plan_block_injection(data, kv_caches, block_ids, first_block=first_block, layout=layout)
    for c in plan.copies:
        scatter_blocks(c.cache, c.layout, c.ids, c.src)
    return plan.tokens


def blocks_to_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """Convert a paged-blocks payload to the token-major format (``[num_tokens, heads, dim]``)."""
    meta, layers = _block_layers(data)
    n = meta.num_tokens
    keys: list[Any] = []
    values: list[Any] = []
    for i, raw in enumerate(layers):
        if raw is None:
            keys.append(None)
            values.append(None)
            continue
        kv = normalize_layer_kv(
            raw, req_id=str(data.get("request_id")), layer_idx=i, layout=meta.kv_layout
        )
        if kv is None:
            raise KVPayloadError(f"layer {i}: block payload does not match layout {meta.kv_layout}")
        ids = list(range(int(kv[0].shape[0])))
        keys.append(gather_request_kv(kv[0], ids, n))
        values.append(gather_request_kv(kv[1], ids, n))
    md = {k: v for k, v in data["metadata"].items() if k != "kv_layout"}
    tokens = PayloadMeta(TOKEN_MAJOR, n, meta.block_size, n, meta.num_layers)
    return {
        "request_id": data.get("request_id"),
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": data.get("block_ids", []),
        "metadata": {**tokens.to_dict(**md), "seq_len": n},
    }
