"""A consumer's mappings of producer segments: cached by name, in use while read.

A load thread copies out of a mapping (into a GPU cache: by DMA, asynchronously, from
memory registered with CUDA) while other threads map other segments; the cache is
bounded, so a mapping may be evicted while a copy still reads it. Each mapping counts
its users, and an evicted one is unregistered and unmapped only once the last of them
is done.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.liveness import STALE_S
from vllm_omni_kv.backends.shm.pinned_map import PinnedMap
from vllm_omni_kv.errors import KVTransferError

__all__ = ["ConsumerMaps"]


@dataclass
class _Mapping:
    mm: PinnedMap
    users: int = 0
    retired: bool = False  # evicted or dropped: closed once its last user released it


class ConsumerMaps:
    """Mappings of producer segments a consumer has read from, cached by name.

    Every :meth:`acquire` is matched by one :meth:`release` (the reader of a claimed
    segment releases it when it hands the segment back). A mapping evicted or dropped
    while in use is unregistered from CUDA and closed only once its last user released
    it, so another load thread never copies out of memory unregistered under it. Only
    pooled segments are registered (``pin``), in the background (:mod:`.pinned_map`): a
    one-shot one is read once, and registering costs more than its copy gains.
    """

    def __init__(self, max_maps: int = 64, stale_s: float = STALE_S) -> None:
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._open: dict[int, _Mapping] = {}  # id(mm) -> every mapping not closed yet
        self._lock = threading.Lock()
        self.max_maps = max_maps
        self.stale_s = stale_s  # a producer heartbeat older than this is dead

    def acquire(self, name: str, pin: bool = True) -> PinnedMap:
        """The mapping of segment ``name``, in use until :meth:`release`."""
        with self._lock:
            hit = self._maps.get(name)
            if hit is not None:
                self._maps.move_to_end(name)
                hit.users += 1
                return hit.mm
        mm = _map_file(name)
        with self._lock:
            raced = self._maps.get(name)
            if raced is None:
                mapping = self._maps[name] = _Mapping(mm, users=1)
                self._open[id(mm)] = mapping
                closing = self._evict_locked()
            else:
                raced.users += 1
        if raced is not None:  # another thread mapped it meanwhile: keep one mapping
            arena.close_map(mm)
            return raced.mm
        if pin:
            mm.pin_later()  # in the background: copies run by DMA once it lands
        for old in closing:
            arena.close_map(old)
        return mm

    def release(self, mm: mmap.mmap) -> None:
        """One user of ``mm`` is done with it (its copies have completed)."""
        with self._lock:
            mapping = self._open.get(id(mm))
            if mapping is None or mapping.mm is not mm:
                return
            mapping.users -= 1
            closing = self._close_if_idle_locked(mapping)
        for old in closing:
            arena.close_map(old)

    def in_use(self) -> int:
        """How many mappings have users (evicted ones included)."""
        with self._lock:
            return sum(1 for m in self._open.values() if m.users > 0)

    def _evict_locked(self) -> list[mmap.mmap]:
        closing: list[mmap.mmap] = []
        while len(self._maps) > self.max_maps:
            _n, old = self._maps.popitem(last=False)
            old.retired = True
            closing += self._close_if_idle_locked(old)
        return closing

    def _close_if_idle_locked(self, mapping: _Mapping) -> list[mmap.mmap]:
        if not mapping.retired or mapping.users > 0:
            return []
        self._open.pop(id(mapping.mm), None)
        return [mapping.mm]

    def drop(self, name: str) -> None:
        """Forget segment ``name`` (unlinked); its mapping closes once no one uses it."""
        with self._lock:
            mapping = self._maps.pop(name, None)
            closing: list[mmap.mmap] = []
            if mapping is not None:
                mapping.retired = True
                closing = self._close_if_idle_locked(mapping)
        for mm in closing:
            arena.close_map(mm)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
            closing: list[mmap.mmap] = []
            for mapping in maps:
                mapping.retired = True
                closing += self._close_if_idle_locked(mapping)
        for mm in closing:
            arena.close_map(mm)


def _map_file(name: str) -> PinnedMap:
    """Map segment file ``name`` (it must belong to this process's user)."""
    fd = os.open(arena.path(name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise KVTransferError(
                f"segment {name} belongs to uid {st.st_uid}, not to this process's uid "
                f"{os.getuid()}: producer and consumer must run as the same user"
            )
        return PinnedMap(fd, st.st_size, flags=mmap.MAP_SHARED | arena.POPULATE)
    finally:
        os.close(fd)
