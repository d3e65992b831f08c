"""Page views of a consumer's own layer tensors, made once and reused across moves.

:func:`~vllm_omni_kv.kvcache.cache_layout.page_view` costs a few torch calls per layer;
a consumer copies into the same layer tensors move after move. :class:`PageViewCache`
keeps the page views of each list of layer tensors it was asked for, under the tensors'
identities. An entry is used only while every tensor it was made from is the very object
asked for (a weak reference to each, so the cache never keeps a tensor alive) and still
starts at the address its view was made at; a weak reference's callback drops the entry
when any of its tensors is freed, so no cached view keeps a freed cache's memory alive
(the views are made from ``detach()`` aliases: a view of the tensor itself would keep
the tensor alive through its ``_base``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view

_Entry = tuple[list["weakref.ref[torch.Tensor]"], list[torch.Tensor]]


class PageViewCache:
    """Page views per list of layer tensors and layout identity (at most :attr:`MAX`)."""

    MAX = 8

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._lock = threading.Lock()

    def pages(self, caches: Sequence[torch.Tensor], ident: KVLayoutId) -> list[torch.Tensor]:
        """``[page_view(t, ident) for t in caches]``, reused while still valid."""
        key = (ident, *map(id, caches))
        hit = self._entries.get(key)
        if hit is not None and _valid(hit, caches):
            return hit[1]
        pages = [page_view(t.detach(), ident) for t in caches]  # no link to ``t`` itself
        entries = self._entries

        def drop(_ref: Any, key: tuple[Any, ...] = key) -> None:
            entries.pop(key, None)  # a tensor of the entry was freed

        entry = ([weakref.ref(t, drop) for t in caches], pages)
        with self._lock:
            if len(entries) >= self.MAX and key not in entries:
                entries.pop(next(iter(entries)), None)
            entries[key] = entry
        return pages

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _valid(entry: _Entry, caches: Sequence[torch.Tensor]) -> bool:
    """Whether ``entry`` was made from exactly ``caches``, each still at its address."""
    refs, pages = entry
    if len(refs) != len(caches):
        return False
    for ref, t, pv in zip(refs, caches, pages, strict=True):
        if ref() is not t or pv.data_ptr() != t.data_ptr():
            return False
    return True
