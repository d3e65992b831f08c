"""PageViewCache: a consumer's page views reused across moves, never stale.

An entry is reused only for the very tensors it was made from, each still at the
address its view was made at; a freed tensor drops its entry (the cache keeps no
tensor's memory alive), and a tensor given other storage gets views of that storage.
"""

from __future__ import annotations

import gc
import weakref

import torch

from vllm_omni_kv.kvcache.cache_layout import infer_identity, page_view
from vllm_omni_kv.kvcache.page_view_cache import PageViewCache

BLOCKS, HEADS, BS, DIM = 6, 2, 4, 8


def _caches(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16) for _ in range(n)]


def test_views_are_reused_for_the_same_tensors() -> None:
    cache, caches = PageViewCache(), _caches()
    ident = infer_identity(caches[0], packing="k_v")
    first = cache.pages(caches, ident)
    assert cache.pages(list(caches), ident) is first  # another list of the same tensors
    for pv, c in zip(first, caches, strict=True):
        assert torch.equal(pv, page_view(c, ident)) and pv.data_ptr() == c.data_ptr()
    other = _caches()
    assert cache.pages(other, ident) is not first
    assert cache.pages(caches[:1], ident) is not first  # a subset is its own entry
    assert len(cache) == 3


def test_a_freed_tensor_drops_its_entry_and_its_memory() -> None:
    cache, caches = PageViewCache(), _caches()
    ident = infer_identity(caches[0], packing="k_v")
    view = weakref.ref(cache.pages(caches, ident)[0])
    caches.pop(0)
    gc.collect()
    assert len(cache) == 0, "a freed tensor's entry stayed"
    assert view() is None, "the cache kept a view of a freed tensor (and so its memory)"
    fresh = _caches(1) + caches  # perhaps at the freed tensor's id: never its views
    pages = cache.pages(fresh, ident)
    pages[0][3].fill_(1.0)
    assert fresh[0][3].eq(1.0).all() and pages[0].data_ptr() == fresh[0].data_ptr()


def test_a_tensor_given_new_storage_gets_views_of_it() -> None:
    cache, caches = PageViewCache(), _caches()
    ident = infer_identity(caches[0], packing="k_v")
    old = cache.pages(caches, ident)
    caches[0].set_(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16))
    pages = cache.pages(caches, ident)
    assert pages is not old and pages[0].data_ptr() == caches[0].data_ptr()
    pages[0][2].fill_(3.0)  # a copy through the views lands in the tensor's memory now
    assert caches[0][2].eq(3.0).all()
    assert not old[0].eq(3.0).any()  # the views of the memory it had before


def test_clear_and_the_bound() -> None:
    cache = PageViewCache()
    sets = [_caches(1) for _ in range(PageViewCache.MAX + 3)]
    ident = infer_identity(sets[0][0], packing="k_v")
    for s in sets:
        cache.pages(s, ident)
    assert len(cache) == PageViewCache.MAX
    cache.clear()
    assert len(cache) == 0
