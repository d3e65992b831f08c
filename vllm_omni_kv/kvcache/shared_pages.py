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

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, check_view, page_view
from vllm_omni_kv.kvcache.meta import SHARED_PAGES, PayloadMeta
from vllm_omni_kv.kvcache.move_plan import MovePlan
from vllm_omni_kv.kvcache.move_plan import page_runs as page_runs  # re-exported
from vllm_omni_kv.kvcache.movers import move
from vllm_omni_kv.kvcache.page_digests import check_pages as check_pages  # re-exported
from vllm_omni_kv.kvcache.page_digests import page_digests, page_sums
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


_FOUR_INTS = [int] * 4


def same_geometry(checked: Geometry, got: Any) -> bool:
    """Whether ``got`` is ``checked`` (a geometry :func:`attach_layers` accepted) in value
    and in type: equal lists of exact ints (no bool or float standing in for one)."""
    if checked != got:
        return False  # equal from here: lists wherever ``checked`` has a list
    return all(
        type(g[0]) is int and list(map(type, g[1])) == _FOUR_INTS == list(map(type, g[2]))
        for g in got
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
        sums = [page_digests(pv, rows[i]) for i, pv in enumerate(pages)] if digests else None
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


class PageCopy(NamedTuple):
    """One part of a move out of a producer's cache: layers at ``geometry`` in its region
    (pages of ``ident``) into the local page views of ``caches``, producer page ``s`` to
    local page ``d`` for each pair; ``sums``: per-layer payload digests to verify
    (``pairs[j]`` is payload page ``first + j``)."""

    geometry: Any
    ident: KVLayoutId
    caches: Sequence[torch.Tensor]
    pairs: Sequence[tuple[int, int]]
    sums: list[list[int]] | None
    first: int


def copy_pages(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    sums: list[list[int]] | None = None,
    first: int = 0,
) -> int:
    """Copy page ``s`` of each layer's ``src`` page view into page ``d`` of ``dst`` for
    every ``(s, d)`` in ``pairs``; returns bytes copied. With ``sums`` (digests of the
    payload's pages; ``pairs[j]`` is payload page ``first + j``) the written pages are
    verified: ``KVPayloadError`` on a mismatch, and (before anything is copied) for a
    pair outside either cache. One :class:`~vllm_omni_kv.kvcache.move_plan.MovePlan`,
    moved by the mover for the two memory kinds (:mod:`~vllm_omni_kv.kvcache.movers`);
    a device move is queued, ordered before the current stream's later work."""
    return move(MovePlan.whole(src, dst, pairs, sums, first))
