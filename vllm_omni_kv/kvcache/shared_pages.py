"""The shared-pages payload: block ids in a cache the consumer can address directly.

When the producer's paged cache lives in memory another process can map (a shared
memory file, a CUDA IPC allocation), a payload need not carry KV bytes: it names the
region, where each layer's view lies in it (byte offset, shape and strides of vLLM's
4-D view), the request's block ids, the layout identity, and optionally one xxh3-64
digest per page. The consumer rebuilds the producer's layer views over its mapping
(every view is bounds-checked against the region first) and copies just the pages it
lacks straight into its own cache: one copy, cache to cache.

``metadata["shared"]`` holds ``{"region", "hold", "geometry", "sums"}`` (and ``groups``
for a model with several KV cache groups: :mod:`~vllm_omni_kv.kvcache.page_groups`); the rest is
:class:`~vllm_omni_kv.kvcache.meta.PayloadMeta` with format ``shared_pages``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, check_view, dense_pages, page_view
from vllm_omni_kv.kvcache.meta import SHARED_PAGES, PayloadMeta
from vllm_omni_kv.kvcache.page_copy import STREAM_MIN_BYTES, copy_runs, pack_runs
from vllm_omni_kv.kvcache.page_groups import (
    GROUPS,
    PageGroup,
    build_groups,
    check_sums,
    groups_field,
    parse_groups,
)
from vllm_omni_kv.wire.payload import KVCacheTransferData

SHARED = "shared"
#: copies of host pages are split in steps of about this size, each verified while in cache
VERIFY_STEP = 1 << 20

Geometry = list[list[Any]]  # per layer: [byte offset, shape (4 ints), stride (4 ints)]


def layer_geometry(caches: Sequence[torch.Tensor], base_ptr: int, nbytes: int) -> Geometry | None:
    """Where each of vLLM's layer views lies in the region ``[base_ptr, base_ptr+nbytes)``;
    None when any view reaches outside it (the cache was not allocated there)."""
    out: Geometry = []
    for c in caches:
        esize = c.element_size()
        off = c.data_ptr() - base_ptr
        span = (sum((s - 1) * st for s, st in zip(c.shape, c.stride(), strict=True)) + 1) * esize
        if off < 0 or off + span > nbytes or any(st < 0 for st in c.stride()):
            return None
        out.append([off, list(c.shape), list(c.stride())])
    return out


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_layer_geometry(g: Any) -> bool:
    """``[byte offset, shape (4 ints), stride (4 ints)]``."""
    return (
        isinstance(g, list)
        and len(g) == 3
        and _int(g[0])
        and all(isinstance(v, list) and len(v) == 4 and all(map(_int, v)) for v in g[1:])
    )


def attach_layers(
    region: torch.Tensor, geometry: Any, ident: KVLayoutId, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The producer's layer views over ``region`` (a flat ``uint8`` tensor of its
    allocation). ``KVPayloadError`` for geometry that is malformed, reaches outside the
    region or does not fit ``ident``: nothing is read through an unchecked view."""
    if not isinstance(geometry, list) or not geometry:
        raise KVPayloadError("shared-pages payload: no layer geometry")
    esize = torch.tensor([], dtype=dtype).element_size()
    total = int(region.numel())
    typed = region[: total - total % esize].view(dtype)
    views: list[torch.Tensor] = []
    for i, g in enumerate(geometry):
        if not is_layer_geometry(g):
            raise KVPayloadError(f"shared-pages payload: layer {i} geometry {g!r}")
        off, shape, stride = g[0], list(g[1]), list(g[2])
        if min(shape) < 1 or min(stride) < 0:
            raise KVPayloadError(f"shared-pages payload: layer {i} shape/stride {shape}/{stride}")
        last = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
        if off < 0 or off % esize or off + (last + 1) * esize > total:
            raise KVPayloadError(
                f"shared-pages payload: layer {i} lies outside the producer's {total}-byte "
                "region (a corrupt or hostile payload)"
            )
        try:  # in bounds, yet torch may refuse it (an element count beyond int64)
            view = typed.as_strided(shape, stride, off // esize)
            check_view(view, ident, f"producer layer {i}")
        except Exception as e:
            raise KVPayloadError(f"shared-pages payload: {e}") from None
        views.append(view)
    return views


def _page_digest(page: torch.Tensor) -> int:
    flat = page.reshape(-1).view(torch.uint8)  # a copy only for a strided (non-dense) page
    return xxhash.xxh3_64_intdigest(flat.numpy().data)


def _page_digests(pv: torch.Tensor, ids: Sequence[int]) -> list[int]:
    if not dense_pages(pv):
        return [_page_digest(pv[b]) for b in ids]
    per, stride, base = (
        pv[0].numel() * pv.element_size(),
        pv.stride(0) * pv.element_size(),
        pv.data_ptr(),
    )
    page = ctypes.c_char * per  # hashed in place, by address: no tensor per page
    return [xxhash.xxh3_64_intdigest(page.from_address(base + b * stride)) for b in ids]


def page_sums(pages: Sequence[torch.Tensor], ids: Sequence[int]) -> list[list[int]]:
    """One xxh3-64 digest per page ``ids`` of each layer's page view (host caches)."""
    return [_page_digests(pv, ids) for pv in pages]


def describe_request(
    request_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    caches: Sequence[torch.Tensor],
    ident: KVLayoutId,
    shared: dict[str, Any],
    *,
    digests: bool,
    metadata: dict[str, Any] | None = None,
    groups: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> KVCacheTransferData:
    """The shared-pages payload of the blocks holding ``num_tokens`` tokens; ``shared``
    carries ``region``, ``hold`` and ``geometry`` (the digests are added here).
    ``groups``: per KV cache group, ``(its payload layer indices, its block table)`` (a
    model with several groups: each group names the blocks it keeps,
    :mod:`~vllm_omni_kv.kvcache.page_groups`); None: every layer ``block_ids``."""
    bs = ident.block_size
    needed = -(-int(num_tokens) // bs)
    nblocks = int(caches[0].shape[0]) // ident.ratio
    if groups is not None and needed > 0:
        kept = build_groups(groups, needed, nblocks)
        pages = [page_view(c, ident) for c in caches]
        rows = {i: g.block_ids for g in kept for i in g.layers}
        sums = [_page_digests(pv, rows[i]) for i, pv in enumerate(pages)] if digests else None
        fields = {**shared, "sums": sums, GROUPS: groups_field(kept)}
        meta = PayloadMeta(SHARED_PAGES, int(num_tokens), bs, needed * bs, len(caches), ident)
        md = meta.to_dict(**(metadata or {}), **{SHARED: fields})
        return KVCacheTransferData(request_id, {}, [], md)
    ids = [int(b) for b in block_ids][:needed]
    if needed <= 0 or len(ids) < needed or min(ids) < 0 or max(ids) >= nblocks:
        raise KVPayloadError(
            f"request {request_id}: {num_tokens} tokens need {needed} blocks in [0, {nblocks}), "
            f"got {list(block_ids)[:8]}..."
        )
    sums = page_sums([page_view(c, ident) for c in caches], ids) if digests else None
    meta = PayloadMeta(SHARED_PAGES, int(num_tokens), bs, needed * bs, len(caches), ident)
    md = meta.to_dict(**(metadata or {}), **{SHARED: {**shared, "sums": sums}})
    return KVCacheTransferData(request_id, {}, ids, md)


def is_shared_payload(data: dict[str, Any] | None) -> bool:
    md = data.get("metadata") if isinstance(data, dict) else None
    return isinstance(md, dict) and md.get("format") == SHARED_PAGES


def shared_fields(data: dict[str, Any]) -> tuple[PayloadMeta, dict[str, Any], list[int]]:
    """``(meta, the "shared" mapping, block ids)`` of a shared-pages payload, checked
    (its groups too: the block ids are empty where it has groups)."""
    meta, shared, ids, _groups = shared_groups(data)
    return meta, shared, ids


def shared_groups(
    data: dict[str, Any],
) -> tuple[PayloadMeta, dict[str, Any], list[int], list[PageGroup]]:
    """:func:`shared_fields` and the payload's block groups (one without ``groups``)."""
    meta = PayloadMeta.of(data)
    md = data["metadata"]
    shared = md.get(SHARED)
    ids = data.get("block_ids")
    if not isinstance(shared, dict) or not isinstance(ids, list):
        raise KVPayloadError("shared-pages payload without its region or block ids")
    n = meta.num_blocks
    grouped = shared.get(GROUPS) is not None
    if grouped and n != -(-meta.num_tokens // meta.block_size):
        raise KVPayloadError(f"shared-pages payload: {n} blocks for {meta.num_tokens} tokens")
    if not grouped and (len(ids) != n or not all(isinstance(b, int) and b >= 0 for b in ids)):
        raise KVPayloadError(f"shared-pages payload: {len(ids)} block ids for {n}")
    geometry = shared.get("geometry")
    if not isinstance(geometry, list) or len(geometry) != meta.num_layers:
        raise KVPayloadError(
            f"shared-pages payload: layer geometry for {meta.num_layers} layers expected"
        )
    groups = parse_groups(shared, ids, meta.num_layers, n)
    check_sums(shared.get("sums"), groups, meta.num_layers)
    return meta, shared, ids, groups


def page_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``(index of first pair, src id, dst id, n)`` for runs consecutive on both sides."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (s, d) in enumerate(pairs):
        if runs:
            i0, s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (i0, s0, d0, n + 1)
                continue
        runs.append((i, s, d, 1))
    return runs


def copy_pages(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    sums: list[list[int]] | None = None,
    first: int = 0,
) -> int:
    """Copy page ``s`` of each layer's ``src`` page view into page ``d`` of ``dst`` for
    every ``(s, d)`` in ``pairs``; returns bytes copied. With ``sums`` (digests of the
    payload's pages; ``pairs[j]`` is payload page ``first + j``) each destination page is
    verified right after it is written: ``KVPayloadError`` on a mismatch, and (before
    anything is copied) for a pair outside either cache. Dense host pages are one
    native call per layer (:mod:`~vllm_omni_kv.kvcache.page_copy`; streaming stores for
    copies of at least ``STREAM_MIN_BYTES``); anything else is a tensor copy per run."""
    if pairs and src:  # pages are copied by address: never outside either cache
        s_ids, d_ids = [s for s, _ in pairs], [d for _, d in pairs]
        n_src, n_dst = min(int(p.shape[0]) for p in src), min(int(p.shape[0]) for p in dst)
        if min(s_ids) < 0 or max(s_ids) >= n_src or min(d_ids) < 0 or max(d_ids) >= n_dst:
            raise KVPayloadError(
                f"shared-pages payload: source pages {min(s_ids)}..{max(s_ids)} of the "
                f"producer's {n_src} or destination pages {min(d_ids)}..{max(d_ids)} of "
                f"{n_dst} lie outside a cache (a corrupt payload)"
            )
    runs = page_runs(pairs)
    table = pack_runs(sorted((s0, d0, n) for _i0, s0, d0, n in runs))  # reads in order
    stream = bool(src) and len(pairs) * sum(_page_bytes(p) for p in src) >= STREAM_MIN_BYTES
    moved = 0
    for layer, (sp, dp) in enumerate(zip(src, dst, strict=True)):
        esize, per = sp.element_size(), _page_bytes(sp)
        s_stride, d_stride = sp.stride(0) * esize, dp.stride(0) * dp.element_size()
        host = dense_pages(sp) and dense_pages(dp) and s_stride >= per
        if host and sums is None and d_stride >= per:  # the common case: one native call
            moved += copy_runs(
                (dp.data_ptr(), d_stride, int(dp.shape[0])),
                (sp.data_ptr(), s_stride, int(sp.shape[0])),
                per,
                table,
                stream,
            )
            continue
        for i0, s0, d0, n in runs:
            if host:
                step = max(1, VERIFY_STEP // per) if s_stride == per == d_stride else 1
                for j in range(0, n, step):
                    k = min(step, n - j)
                    ctypes.memmove(
                        dp.data_ptr() + (d0 + j) * d_stride,
                        sp.data_ptr() + (s0 + j) * s_stride,
                        k * per,
                    )
                    if sums is not None:
                        check_pages(dp, d0 + j, k, sums[layer], first + i0 + j, layer)
            else:
                dp[d0 : d0 + n].copy_(sp[s0 : s0 + n], non_blocking=True)
                if sums is not None:
                    check_pages(dp, d0, n, sums[layer], first + i0, layer)
            moved += n * per
    return moved


def _page_bytes(pv: torch.Tensor) -> int:
    return int(pv[0].numel()) * pv.element_size()


def check_pages(
    dp: torch.Tensor,
    d0: int,
    n: int,
    sums: list[int],
    p0: int,
    layer: int,
    what: str = "shared-pages payload",
) -> None:
    """Verify pages ``d0..d0+n`` of the page view ``dp`` against payload pages ``p0..``
    of ``sums`` (hashed in place on the host; device pages are copied to the host first);
    ``KVPayloadError`` naming ``what``, the layer and the page on a mismatch."""
    pages = dp if dp.device.type == "cpu" else dp[d0 : d0 + n].cpu()
    ids = range(d0, d0 + n) if dp.device.type == "cpu" else range(n)
    for j, got in enumerate(_page_digests(pages, ids)):
        if got != sums[p0 + j]:
            raise KVPayloadError(
                f"{what}: layer {layer} page {p0 + j} does not match the producer's digest "
                "(its block was rewritten while being read)"
            )
