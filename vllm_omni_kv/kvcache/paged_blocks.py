"""The paged-blocks payload format: a request's pages (manager blocks of each layer), as
the producer's cache holds them, plus the cache's layout identity.

``layer_blocks["kv_blocks"]`` holds, per layer, a ``[n, *page_shape]`` tensor: the
request's ``n`` blocks in the producer's intra-block order (``[ratio, H, N, C]`` or
``[ratio, N, H, C]``, see :mod:`vllm_omni_kv.kvcache.cache_layout`; None for a
skipped layer). The metadata is :class:`~vllm_omni_kv.kvcache.meta.PayloadMeta`
whose ``kv_layout`` is the producer's :class:`KVLayoutId`.

A receiver plans where each page goes (:func:`plan_block_injection`): byte for byte
(one memcpy per run of blocks into a host cache) when both identities give the bytes
the same meaning; through K/V token views when they differ losslessly (CPU vs
FlashAttention packing, NHD vs HND, other kernel blocks); else the load fails naming
both. The plan names the frame spans it needs (a local prefix is not loaded).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import (
    CELL_PACKINGS,
    KVLayoutId,
    bits,
    block_token_views,
    check_view,
    infer_identity,
    logical_from_pages,
    page_view,
)
from vllm_omni_kv.kvcache.device_order import settle, streams_of
from vllm_omni_kv.kvcache.device_staging import DeviceStager, layer_callbacks
from vllm_omni_kv.kvcache.layer_windows import (
    check_window,
    first_blocks_field,
    layer_windows,
    payload_first_blocks,
)
from vllm_omni_kv.kvcache.meta import PAGED_BLOCKS, TOKEN_MAJOR, PayloadMeta
from vllm_omni_kv.kvcache.page_convert import convert_pages
from vllm_omni_kv.kvcache.page_gather import (
    STEP_BYTES,
    addressable,
    block_runs,
    host_bytes,
    iter_gather_pages,
)
from vllm_omni_kv.kvcache.page_scatter import PageCopy, apply_scatter, scatter_all
from vllm_omni_kv.wire.codec import LazyTensor
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import CopyOut, PayloadStream, Span, merge_spans

KV_BLOCKS = "kv_blocks"
#: a ``layout`` argument: an identity, None (read from the tensor) or "cpu" (vLLM's CPU backend)
LayoutArg = KVLayoutId | str | None


def resolve_identity(cache: torch.Tensor, layout: LayoutArg) -> KVLayoutId:
    """The identity of ``cache``: ``layout`` when given, else read from the tensor."""
    if isinstance(layout, KVLayoutId):
        check_view(cache, layout)
        return layout
    if layout not in (None, "cpu"):
        raise ConfigError(f"layout {layout!r}: pass a KVLayoutId (or 'cpu' for vLLM's CPU backend)")
    if not isinstance(cache, torch.Tensor):
        raise KVPayloadError(
            "paged-blocks payloads need one tensor per layer: use the token-major format"
        )
    return infer_identity(cache, packing="kt_v" if layout == "cpu" else None)


def block_bytes(cache: torch.Tensor, layout: LayoutArg = None) -> int:
    """Bytes of one page (one manager block of one layer) of ``cache``."""
    return resolve_identity(cache, layout).page_bytes


def extract_request_blocks(
    request_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    kv_caches: Sequence[torch.Tensor | None],
    *,
    layout: LayoutArg = None,
    metadata: dict[str, Any] | None = None,
    stager: DeviceStager | None = None,
    layer_ids: Sequence[Sequence[int]] | None = None,
    layer_first: Sequence[int] | None = None,
) -> KVCacheTransferData:
    """A paged-blocks payload of the blocks holding ``num_tokens`` tokens (lazy: one copy at
    pack time). ``kv_caches`` are vLLM's per-layer 4-D views; ``layout`` their identity.
    ``layer_ids``/``layer_first``: each layer's own block table and first kept block
    (hybrid models, :mod:`~vllm_omni_kv.kvcache.layer_windows`); by default every layer
    sends blocks ``block_ids`` from the first.

    With ``stager`` (a cache on its device) the pages of every layer are gathered at once
    into its staging buffer, ordered after the current stream's work, and packing copies
    them out of it; without one, or when the request does not fit, packing reads the cache.
    """
    first = next((c for c in kv_caches if c is not None), None)
    if first is None:
        raise KVPayloadError(f"request {request_id}: no layer has a KV cache")
    ident = resolve_identity(first, layout)
    bs = ident.block_size
    needed = -(-int(num_tokens) // bs)
    if needed <= 0 or len(block_ids) < needed:
        raise KVPayloadError(
            f"request {request_id}: {num_tokens} tokens need {needed} blocks of {bs}, "
            f"got {len(block_ids)}"
        )
    windows = layer_windows(block_ids, needed, len(kv_caches), layer_ids, layer_first)
    nblocks = int(first.shape[0]) // ident.ratio
    if any(min(w[f:]) < 0 or max(w[f:]) >= nblocks for w, f in windows):
        raise KVPayloadError(f"request {request_id}: block id out of range [0, {nblocks})")
    views: list[torch.Tensor | None] = []
    for i, cache in enumerate(kv_caches):
        if cache is not None:
            check_view(cache, ident, f"layer {i}")
        views.append(None if cache is None else page_view(cache, ident))
    ids = windows[0][0]
    if layer_ids is None and layer_first is None and stager is not None:
        staged = stager.gather(views, ids) if stager.device == first.device else None
    else:
        staged = None  # hybrid tables: every layer reads its own pages
    layers: list[Any] = []
    for i, (pv, (own, f)) in enumerate(zip(views, windows, strict=True)):
        if pv is None:
            layers.append(None)
            continue
        fill, place = layer_callbacks(staged, i, functools.partial(iter_gather_pages, pv, own[f:]))
        layers.append(LazyTensor((needed - f, *ident.page_shape), pv.dtype, fill, pv.device, place))
    meta = PayloadMeta(PAGED_BLOCKS, int(num_tokens), bs, needed * bs, len(layers), ident)
    extra = {**(metadata or {}), **(first_blocks_field(windows) if layer_first else {})}
    return KVCacheTransferData(request_id, {KV_BLOCKS: layers}, ids, meta.to_dict(**extra))


def is_block_payload(data: dict[str, Any] | None) -> bool:
    md = data.get("metadata") if isinstance(data, dict) else None
    return isinstance(md, dict) and md.get("format") == PAGED_BLOCKS


def _block_layers(data: dict[str, Any]) -> tuple[PayloadMeta, KVLayoutId, list[Any]]:
    meta, blocks = PayloadMeta.of(data), data.get("layer_blocks")
    layers = blocks.get(KV_BLOCKS) if isinstance(blocks, dict) else None
    if meta.format != PAGED_BLOCKS or not isinstance(layers, list) or meta.kv_layout is None:
        raise KVPayloadError("not a paged-blocks payload (no kv_blocks list)")
    return meta, meta.kv_layout, layers


@dataclass
class _Copy:
    src: torch.Tensor  # the payload pages to write, ``[n, *page_shape]`` (a view of the frame)
    cache: torch.Tensor  # the local layer (vLLM's 4-D view)
    ids: list[int]  # local block ids, one per payload page of ``src``


#: (frame end offset, dst address, src address, nbytes, dst view, fallback)
_Task = tuple[int, int, int, int, memoryview | None, Callable[[], None] | None]


def _span(t: torch.Tensor, frame_address: int) -> Span:
    start = t.data_ptr() - frame_address
    return start, start + t.numel() * t.element_size()


class BlocksPlan:
    """Where each payload page goes; built by :func:`plan_block_injection`."""

    #: whether the plan writes pages only (into a device cache: through :mod:`.page_scatter`)
    pages_only = True

    def __init__(self, tokens: int, copies: list[_Copy], src: KVLayoutId, dst: KVLayoutId) -> None:
        self.tokens = tokens
        self.copies = copies
        self.src_layout, self.dst_layout = src, dst
        self.raw = dst.same_pages(src)
        self._ids: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """``ids`` as an index on ``device``: built once per plan for each list of ids
        (layers share one), uploaded from pinned memory without a host wait on CUDA."""
        key = (str(device), tuple(ids))
        if key not in self._ids:
            host = torch.tensor(ids, dtype=torch.long)
            if device.type == "cuda":
                host = host.pin_memory()
            self._ids[key] = host.to(device, non_blocking=True)
        return self._ids[key]

    def spans(self, frame_address: int | None) -> list[Span] | None:
        """The frame bytes the plan reads (None: the whole frame, when not one local frame)."""
        if frame_address is None:
            return None
        return merge_spans([_span(c.src, frame_address) for c in self.copies])

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        """Write the planned pages as their bytes arrive; return the payload's token count.

        Page copies into a host cache take one ``copy_into`` (each chunk verified in
        the cache right after its copy); other layers are written (or converted) one
        at a time once their bytes are final. On any error the local blocks may hold
        part of the payload: do not use them.
        """
        base = stream.frame_address
        streams = streams_of(self.copies[0].cache.device) if self.copies else None
        if streams is not None and self.raw and self.pages_only:  # one host wait
            apply_scatter(stream, self.spans(base), self.page_copies(), deadline, cancel)
            return self.tokens
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
        if streams is not None:  # conversions into a device cache: done before the frame goes
            settle(streams, self.copies[0].cache.device)
        return self.tokens

    def page_copies(self) -> list[PageCopy]:
        """The plan's copies for :mod:`.page_scatter` (identities with the same bytes)."""
        return [PageCopy(c.src, page_view(c.cache, self.dst_layout), c.ids) for c in self.copies]

    def write(self, c: _Copy) -> None:
        """Write one layer's pages (after its bytes are final), converting when needed."""
        if self.raw:
            pv = page_view(c.cache, self.dst_layout)
            # same bytes, possibly another page shape: with one KV head an HNC page and
            # an NHC page differ only in where the size-1 head axis sits
            src = c.src.reshape(c.src.shape[0], *self.dst_layout.page_shape)
            idx = self.index(c.ids, pv.device)
            bits(pv).index_copy_(0, idx, bits(src).to(pv.device, non_blocking=True))
        else:
            idx = self.index(c.ids, c.cache.device)
            convert_pages(c.src, self.src_layout, c.cache, self.dst_layout, idx)

    def _tasks(self, frame_address: int | None) -> list[_Task]:
        """One task per copy, in frame order.

        Runs of pages that are adjacent in a host cache are merged up to
        ``STEP_BYTES`` so each copy starts as soon as its bytes are final; other
        layers are one :meth:`write` once their last needed byte is final.
        """
        tasks: list[_Task] = []
        for c in self.copies:
            pv = page_view(c.cache, self.dst_layout)
            host = c.src.device.type == "cpu" and streams_of(pv.device) is None
            addr = addressable(pv) if self.raw and host else None
            if frame_address is None or addr is None:
                end = 0 if frame_address is None else _span(c.src, frame_address)[1]
                tasks.append((end, 0, 0, 0, None, functools.partial(self.write, c)))
                continue
            per, stride = addr
            start = c.src.data_ptr() - frame_address
            limit = max(1, STEP_BYTES // per) if stride == per else 1
            whole = host_bytes(pv)
            base, s = pv.data_ptr(), c.src.data_ptr()
            runs = block_runs(c.ids) if stride == per else [(i, b, 1) for i, b in enumerate(c.ids)]
            for off, first, n in runs:
                for j in range(0, n, limit):
                    k = min(limit, n - j)
                    at = (first + j) * stride
                    view = whole[at : at + k * per]
                    end = start + (off + j + k) * per
                    tasks.append((end, base + at, s + (off + j) * per, k * per, view, None))
        tasks.sort(key=lambda t: t[0])
        return tasks


def _target_identity(cache: torch.Tensor, layout: LayoutArg, src_id: KVLayoutId) -> KVLayoutId:
    """The local cache's identity; ``KVPayloadError`` when ``src_id`` pages cannot be
    written into it losslessly."""
    dst_id = resolve_identity(cache, layout)
    why = dst_id.conversion_refusal(src_id)
    if why is not None:
        raise KVPayloadError(
            f"the payload's KV ({src_id.describe()}) cannot be written into this cache "
            f"({dst_id.describe()}): {why}; producer and consumer need the same model, "
            "dtype, block size and TP"
        )
    return dst_id


def plan_block_injection(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
    layout: LayoutArg = None,
    layer_ids: Sequence[Sequence[int]] | None = None,
    layer_first: Sequence[int] | None = None,
    layer_offset: int = 0,
) -> BlocksPlan:
    """Check a paged-blocks payload against the local cache (header only, no bytes read).

    ``kv_caches`` are the local layers the payload (or part) covers, the first of them
    payload layer ``layer_offset``; payload block ``j`` goes to local block
    ``block_ids[j]`` for ``j >= first_block`` (the blocks before it are already held
    locally). ``layer_ids``/``layer_first``: each local layer's own table and first
    block to write (hybrid models). Raises ``KVPayloadError`` when the payload's layout
    identity cannot be written into the local cache losslessly, or a layer needs blocks
    the payload does not hold.
    """
    meta, src_id, layers = _block_layers(data)
    if len(layers) != len(kv_caches):
        raise KVPayloadError(
            f"payload has {len(layers)} layers, the local model has {len(kv_caches)}"
        )
    first_cache = next((c for c in kv_caches if c is not None), None)
    if first_cache is None:
        return BlocksPlan(meta.num_tokens, [], src_id, src_id)
    dst_id = _target_identity(first_cache, layout, src_id)
    needed = meta.num_blocks
    if len(block_ids) < needed and layer_ids is None:
        raise KVPayloadError(
            f"{meta.rows} token slots need {needed} local blocks, {len(block_ids)} given"
        )
    if not 0 <= first_block <= needed:
        raise KVPayloadError(f"first block {first_block} is outside the payload's {needed} blocks")
    md = data.get("metadata") or {}
    sent = payload_first_blocks(md, meta.num_layers, needed)[layer_offset:]
    if len(sent) < len(layers):
        raise KVPayloadError(f"payload declares {meta.num_layers} layers and holds {len(layers)}")
    copies = []
    for i, (src, cache) in enumerate(zip(layers, kv_caches, strict=True)):
        if cache is None:
            continue
        if src is None:
            raise KVPayloadError(f"payload has no KV for layer {i}, which the local model needs")
        ids = [int(b) for b in (block_ids if layer_ids is None else layer_ids[i])][:needed]
        start = first_block if layer_first is None else int(layer_first[i])
        _check_pages(i, src, needed - sent[i], src_id)
        check_window(i, start, sent[i], needed, len(ids))
        check_view(cache, dst_id, f"local layer {i}")
        if start < needed:
            copies.append(_Copy(src[start - sent[i] :], cache, ids[start:]))
    _check_disjoint([c.src for c in copies])
    return BlocksPlan(meta.num_tokens, copies, src_id, dst_id)


def _check_pages(i: int, src: Any, n: int, ident: KVLayoutId) -> None:
    """Layer ``i`` of a payload must be ``n`` pages of ``ident`` (a tensor)."""
    want = (n, *ident.page_shape)
    got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
    if got != want or src.element_size() != ident.element_size:
        raise KVPayloadError(
            f"layer {i}: payload pages {got} do not match its layout identity "
            f"({ident.describe()}: {want}); the local model needs every layer"
        )


def _check_disjoint(pages: Sequence[torch.Tensor]) -> None:
    """Refuse layers whose pages share bytes (each layer of a payload has its own)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in pages if t.numel())
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        raise KVPayloadError("payload layers share their page bytes: a corrupt payload")


def inject_request_blocks(
    data: dict[str, Any],
    kv_caches: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
    layout: LayoutArg = None,
    layer_ids: Sequence[Sequence[int]] | None = None,
    layer_first: Sequence[int] | None = None,
) -> int:
    """Write a complete paged-blocks payload into blocks ``block_ids`` (per layer: as
    :func:`plan_block_injection` says); return its token count."""
    plan = plan_block_injection(
        data,
        kv_caches,
        block_ids,
        first_block=first_block,
        layout=layout,
        layer_ids=layer_ids,
        layer_first=layer_first,
    )
    streams = streams_of(plan.copies[0].cache.device) if plan.copies else None
    if streams is not None and plan.raw:  # ids uploaded once, one scatter per layer
        scatter_all(plan.page_copies(), plan.copies[0].cache.device, streams)
        return plan.tokens
    for c in plan.copies:
        plan.write(c)
    return plan.tokens


def blocks_to_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """Convert a paged-blocks payload to the token-major format (``[num_tokens, heads, dim]``)."""
    meta, ident, layers = _block_layers(data)
    if any(payload_first_blocks(data["metadata"], meta.num_layers, meta.num_blocks)):
        raise KVPayloadError(
            "a payload whose layers hold different blocks (several KV cache groups) has no "
            "token-major form: run producer and consumer with the same TP size"
        )
    if ident.packing in CELL_PACKINGS:
        what = "an MLA latent" if ident.packing == "latent" else "a packed (quantized)"
        raise KVPayloadError(
            f"{what} payload has no K/V to merge or slice across TP sizes: run "
            "producer and consumer with the same TP size"
        )
    n, keys, values = meta.num_tokens, list[Any](), list[Any]()
    for i, raw in enumerate(layers):
        if raw is None:
            keys.append(None)
            values.append(None)
            continue
        _check_pages(i, raw, meta.num_blocks, ident)
        k, v = block_token_views(logical_from_pages(raw, ident), ident)
        assert v is not None
        for out, t in ((keys, k), (values, v)):
            out.append(t.reshape(-1, *t.shape[3:])[:n].contiguous())
    md = {k: v for k, v in data["metadata"].items() if k != "kv_layout"}
    tokens = PayloadMeta(TOKEN_MAJOR, n, meta.block_size, n, meta.num_layers)
    return {
        "request_id": data.get("request_id"),
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": data.get("block_ids", []),
        "metadata": {**tokens.to_dict(**md), "seq_len": n},
    }
