"""The producer's KV cache in a shared-memory file, and consumers' mappings of it.

Producer: vLLM allocates the KV cache as one ``torch.zeros(n, dtype=int8)`` on the
host (``vllm.v1.worker.utils.allocate_kv_cache``); inside
:meth:`ShmCacheRegion.allocation_context` that call returns a tensor over a new arena
segment ``omnikv_seg_<pid>_<ns>_kv<id>`` instead (bytes at offset 4096; the slot header
before them carries the heartbeat, so the sweeper removes the file of a dead
producer). Any other allocation in the context is left alone. Where the segment cannot
be created (a small ``/dev/shm``), vLLM's own allocation runs and
:attr:`~ShmCacheRegion.unavailable_reason` says why; where vLLM allocated the cache
elsewhere, :meth:`~ShmCacheRegion.check_placement` raises ``ConfigError``.

Consumer: a payload names the segment; the consumer maps it (at most :data:`MAX_MAPS`
producers' caches, least recently used out first) and copies pages under the payload's
hold (:mod:`.hold_files`).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.backends.cache_region import AllocateHostCache, CacheRegion, check_generation
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.hold_files import HoldFiles
from vllm_omni_kv.backends.shm.liveness import (
    W_BEAT,
    W_OWNER,
    W_PIDNS,
    now_ms,
    owner_alive,
    owner_ident,
)
from vllm_omni_kv.backends.shm.pinned_map import PinnedMap
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.shared_pages import layer_geometry
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: where the KV bytes start in a cache segment (one page after the slot header)
KV_OFFSET = 4096
_SLOT_HEAD = struct.Struct(f"<{arena.SLOT_WORDS}Q")
#: producers' caches a consumer keeps mapped at most (one per producer rank it reads from;
#: a mapping of a producer that is gone is dropped at the next new mapping)
MAX_MAPS = 64


class ShmCacheRegion(HoldFiles, CacheRegion):
    """A host KV cache in a shared-memory file (producer) / mappings of them (consumer)."""

    kind = "shm"
    off_switch = "set backend_extra.share_cache: false (packed payloads)"

    def __init__(self, namespace: str, producer: ProducerArena, stale_s: float) -> None:
        super().__init__(namespace)
        self.producer = producer
        self.stale_s = stale_s
        self.tensor: torch.Tensor | None = None
        self._seg: arena.Segment | None = None
        self._context: AllocateHostCache | None = None
        # consumer side: producers' caches mapped, least recently used first
        self._maps: OrderedDict[str, tuple[int, mmap.mmap, torch.Tensor]] = OrderedDict()
        self._maps_lock = threading.Lock()

    # -- producer ------------------------------------------------------------------------
    def allocation_context(self) -> AllocateHostCache:
        self._context = AllocateHostCache(self.allocate)
        return self._context

    def context_entered(self) -> bool:
        return self._context is not None and self._context.entered

    def describe(self) -> str:
        if self._seg is None:
            return "the shared-memory cache region (no segment)"
        return f"the shared-memory cache region {arena.path(self._seg.name)}"

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A zeroed ``int8`` tensor of ``nbytes`` in a new cache segment of this process;
        None, with :attr:`unavailable_reason` set, where the segment cannot be created."""
        kind = arena.CACHE_IDS[0]  # "kv": how the inventory tells a cache from a payload segment
        name = f"{arena.SEG_PREFIX}{os.getpid()}_{self.tag}_{kind}{uuid.uuid4().hex[:14]}"
        try:
            mm = self._map_segment(name, nbytes)
        except KVTransferError as e:  # no room: arena._create_file's posix_fallocate
            self.unavailable_reason = str(e)
            return None
        except OSError as e:
            self.unavailable_reason = f"cannot create {arena.path(name)}: {e}"
            return None
        mm.pin_later()  # in the background: vLLM's start does not wait for it
        self._seg = arena.Segment(name, nbytes, mm)
        self.producer.adopt(self._seg)
        self.owner_name = name
        self.tensor = torch.frombuffer(
            arena.exported(mm), dtype=torch.int8, count=nbytes, offset=KV_OFFSET
        )
        logger.info(
            "KV cache (%.1f MiB) allocated in shared memory %s: consumers copy its pages directly",
            nbytes / 2**20,
            arena.path(name),
        )
        return self.tensor

    def _map_segment(self, name: str, nbytes: int) -> PinnedMap:
        """Create cache segment ``name`` for ``nbytes`` of KV cache (its pages reserved) and
        map it; ``KVTransferError`` when ``/dev/shm`` has no room for it."""
        head = np.zeros(arena.SLOT_WORDS, dtype="<u8")
        head[[W_OWNER, W_BEAT, W_PIDNS]] = (self.producer.instance, now_ms(), owner_ident())
        fd = arena._create_file(
            name,
            KV_OFFSET + nbytes,
            head.tobytes(),
            f"the {nbytes / 2**20:.1f} MiB KV cache",
            "enlarge it (Docker: --shm-size) or give vLLM a smaller KV cache "
            "(kv_cache_memory_bytes)",
        )
        try:
            return PinnedMap(fd, KV_OFFSET + nbytes, flags=mmap.MAP_SHARED | arena.POPULATE)
        except BaseException:
            arena.unlink_quiet(name)
            raise
        finally:
            os.close(fd)

    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        if self.tensor is None or self._seg is None or not caches:
            return None
        base, nbytes = self.tensor.data_ptr(), int(self.tensor.numel())
        if layer_geometry(caches, base, nbytes) is None:
            return None
        desc = {
            "kind": self.kind,
            "name": self._seg.name,
            "owner": self.producer.instance,
            "generation": self.generation,
        }
        return desc, base, nbytes

    def _withdraw(self) -> None:
        self._publish_generation()
        self.void_holds()
        self._drop_maps()  # consumer: no copy runs now (vLLM's sleep waits for the loads)

    def _restore(self) -> None:
        self._publish_generation()

    def _publish_generation(self) -> None:
        """Producer: the cache segment's header names the generation consumers check."""
        if self._seg is not None:
            self._seg.set_state(self._seg.state()[0], self.generation)

    # -- consumer ------------------------------------------------------------------------
    def attach(self, descriptor: Any) -> torch.Tensor:
        if not isinstance(descriptor, dict) or descriptor.get("kind") != self.kind:
            raise KVPayloadError(f"not a shared-memory cache region: {descriptor!r}")
        name, owner = descriptor.get("name"), descriptor.get("owner")
        if not isinstance(name, str) or not name.startswith(arena.SEG_PREFIX) or "/" in name:
            raise KVPayloadError(f"shared-pages payload names no cache segment: {name!r}")
        if not isinstance(owner, int):
            raise KVPayloadError(f"shared-pages payload names no producer instance: {owner!r}")
        with self._maps_lock:
            hit = self._maps.get(name)
            if hit is not None and hit[0] == owner and self._alive(name, hit[1]):
                self._maps.move_to_end(name)
                check_generation(descriptor, _generation(hit[1]))
                return hit[2]
            gone = self._stale_locked()  # a producer that restarted left its old cache
        for mm in gone:
            arena.close_map(mm)
        if hit is not None and hit[0] == owner:
            raise self._not_alive(name)
        mm = self._map(name, owner)
        try:
            check_generation(descriptor, _generation(mm))
        except BaseException:
            arena.close_map(mm)
            raise
        mm.pin_later()  # in the background: this load's copies stay synchronous until it lands
        size = len(mm)
        view = torch.frombuffer(
            arena.exported(mm), dtype=torch.uint8, count=size - KV_OFFSET, offset=KV_OFFSET
        )
        with self._maps_lock:
            raced = self._maps.pop(name, None)  # another load mapped it meanwhile
            self._maps[name] = (owner, mm, view)
            old = [] if raced is None else [raced[1]]
            while len(self._maps) > MAX_MAPS:  # the least recently used goes
                old.append(self._maps.popitem(last=False)[1][1])
        for dropped in old:
            arena.close_map(dropped)
        return view

    def _stale_locked(self) -> list[mmap.mmap]:
        """Forget the mappings of producers that are gone (their memory can go back)."""
        dead = [n for n, (_o, mm, _v) in self._maps.items() if not self._alive(n, mm)]
        return [self._maps.pop(n)[1] for n in dead]

    def _map(self, name: str, owner: int) -> PinnedMap:
        """Map the cache segment ``name`` of the live producer instance ``owner``."""
        try:
            fd = os.open(arena.path(name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise KVTransferError(
                f"the producer's KV cache {arena.path(name)} is gone (the producer exited)"
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise KVPayloadError(
                    f"{arena.path(name)} belongs to uid {st.st_uid}, not to this process's "
                    f"uid {os.getuid()}: run producer and consumer as the same user"
                )
            if st.st_size <= KV_OFFSET:
                raise KVPayloadError(f"{arena.path(name)} is not a KV cache segment")
            mm = PinnedMap(fd, st.st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        words = np.frombuffer(mm, dtype="<u8", count=arena.SLOT_WORDS)
        mine = int(words[W_OWNER]) == owner
        del words
        if not mine or not self._alive(name, mm):
            arena.close_map(mm)
            if not mine:
                raise KVTransferError(
                    f"{arena.path(name)} belongs to another producer instance now"
                )
            raise self._not_alive(name)
        return mm

    def _alive(self, name: str, mm: mmap.mmap) -> bool:
        words = _SLOT_HEAD.unpack_from(mm)
        return owner_alive(words, arena._owner_pid(name), self.stale_s)

    def _not_alive(self, name: str) -> KVTransferError:
        return KVTransferError(
            f"the producer owning {arena.path(name)} is not alive (its process exited, or in "
            f"another PID namespace its heartbeat is over {self.stale_s:g}s old)"
        )

    def close(self) -> None:
        self.close_holds()
        self._drop_maps()
        # the cache segment is the arena's to unlink (adopted), after vLLM let go of it

    def _drop_maps(self) -> None:
        """Consumer: unmap every producer's cache segment."""
        self._views = {}
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for _owner, mm, _view in maps:
            arena.close_map(mm)


def _generation(mm: mmap.mmap) -> int:
    """The generation a cache segment's header names (see ``CacheRegion.generation``)."""
    return int(struct.unpack_from("<Q", mm, 8)[0])  # word 1 of the slot header
