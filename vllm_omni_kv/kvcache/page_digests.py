"""xxh3-64 digests of host pages (one per page), and their check against a payload's.

A page is hashed as its bytes in logical order: dense host pages in place, by address
(no tensor per page); any other page as ``page.reshape(-1)`` viewed as bytes. Device
pages are hashed after they reach the host (the movers gather them into one buffer,
copied once).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import xxhash

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import dense_pages


def _page_digest(page: torch.Tensor) -> int:
    flat = page.reshape(-1).view(torch.uint8)  # a copy only for a strided (non-dense) page
    return xxhash.xxh3_64_intdigest(flat.numpy().data)


def page_digests(pv: torch.Tensor, ids: Sequence[int] | range) -> list[int]:
    """The digest of each page ``ids`` of the host page view ``pv``."""
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
    return [page_digests(pv, ids) for pv in pages]


def verify_digests(got: Sequence[int], sums: Sequence[int], p0: int, layer: int, what: str) -> None:
    """``KVPayloadError`` naming ``what``, the layer and the page unless ``got[j]`` equals
    the payload's ``sums[p0 + j]`` for every ``j``."""
    if p0 < 0 or p0 + len(got) > len(sums):
        raise KVPayloadError(
            f"{what}: layer {layer} has {len(sums)} page digests, not {p0 + len(got)}"
        )
    for j, value in enumerate(got):
        if value != sums[p0 + j]:
            raise KVPayloadError(
                f"{what}: layer {layer} page {p0 + j} does not match the producer's digest "
                "(its block was rewritten while being read)"
            )


def check_pages(
    dp: torch.Tensor,
    d0: int,
    n: int,
    sums: Sequence[int],
    p0: int,
    layer: int,
    what: str = "shared-pages payload",
) -> None:
    """Verify pages ``d0..d0+n`` of the page view ``dp`` against payload pages ``p0..``
    of ``sums`` (hashed in place on the host; device pages are copied to the host first);
    ``KVPayloadError`` naming ``what``, the layer and the page on a mismatch."""
    pages = dp if dp.device.type == "cpu" else dp[d0 : d0 + n].cpu()
    ids = range(d0, d0 + n) if dp.device.type == "cpu" else range(n)
    verify_digests(page_digests(pages, ids), sums, p0, layer, what)
