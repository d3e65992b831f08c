"""The producer's CUDA KV cache exported through CUDA IPC, with hold files on its blocks.

Producer: vLLM allocates the KV cache inside :meth:`CudaIpcRegion.allocation_context`, a
private ``torch.cuda.MemPool``, so the cache is a ``cudaMalloc`` allocation of its own
that CUDA IPC can export (vLLM's sleep-mode allocator and expandable segments cannot
be). :meth:`export` shares the cache's storage once (``_share_cuda_``: an IPC handle of
the allocation, the storage's offset in it) and names the device by UUID (device
numbers differ between processes with different ``CUDA_VISIBLE_DEVICES``). A payload is
block ids (:mod:`vllm_omni_kv.kvcache.shared_pages`); the producer waits for an event
after the step's forward before it publishes a step's payloads, so the pages are final
when a consumer reads them.
:meth:`~CudaIpcRegion.check_placement` verifies that every layer view lies in one of the
pool's segments (``MemPool.snapshot``).

Consumer: opens the handle once per producer, on its own cache's device
(:mod:`.mappings`, which also drops a dead producer's mapping), and copies the pages
it lacks device to device (peer to peer between two GPUs), then synchronizes before it
releases the hold. Holds and liveness are the shared-memory ones
(:class:`~vllm_omni_kv.backends.shm.hold_files.HoldFiles`): a small heartbeat segment
``omnikv_seg_<pid>_<ns>_ipc<id>`` stands for the producer, so a dead producer's holds are
swept and a consumer refuses a handle whose owner stopped beating.

None of this has run on a GPU in this project's CI (no GPU there); ``make gpu-check``
runs its tests on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.backends.cache_region import CacheRegion, check_generation
from vllm_omni_kv.backends.cuda_ipc.mappings import IpcMappings, Mapping, Opener, open_handle
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
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import page_view
from vllm_omni_kv.kvcache.device_order import DeviceEvent, mark, streams_of
from vllm_omni_kv.kvcache.move_plan import MovePlan, Part
from vllm_omni_kv.kvcache.movers import move
from vllm_omni_kv.kvcache.shared_pages import PageCopy, attach_layers, layer_geometry
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: the fields of ``UntypedStorage._share_cuda_()`` after the device, in order
_SHARE_FIELDS = (
    "handle",
    "size",
    "offset",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcRegion(HoldFiles, CacheRegion):
    """A CUDA KV cache shared through CUDA IPC (producer) / opened handles (consumer)."""

    kind = "cuda_ipc"
    digests = False  # hashing device pages would need a device-to-host copy
    places = "cuda"
    off_switch = "use backend 'shm' without share_cache instead (packed payloads)"

    def __init__(
        self,
        namespace: str,
        producer: ProducerArena,
        stale_s: float,
        opener: Opener = open_handle,
    ) -> None:
        """``opener``: how a consumer opens a producer's handle on a local device."""
        super().__init__(namespace)
        self.producer = producer
        self.stale_s = stale_s
        self._pool: Any = None
        self._entered = False
        self._owner_seg: arena.Segment | None = None
        self._mappings = IpcMappings(self._alive, opener)  # consumer side

    # -- producer ------------------------------------------------------------------------
    def allocation_context(self) -> AbstractContextManager[Any] | None:
        if not torch.cuda.is_available():
            return None
        if self._pool is None:
            self._pool = torch.cuda.MemPool()
        return self._entering(torch.cuda.use_mem_pool(self._pool))

    @contextlib.contextmanager
    def _entering(self, ctx: AbstractContextManager[Any]) -> Iterator[Any]:
        self._entered = True
        with ctx as got:
            yield got

    def context_entered(self) -> bool:
        return self._entered

    def allocations(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the private pool's segments (what was allocated in it)."""
        if self._pool is None:
            return []
        return [(int(s["address"]), int(s["total_size"])) for s in self._pool.snapshot(False)]

    def describe(self) -> str:
        return "the CUDA IPC region (a private torch.cuda.MemPool)"

    def owner_segment(self) -> str:
        """The heartbeat segment standing for this producer (created once; consumers
        judge the producer alive by it)."""
        if self._owner_seg is None:
            kind = arena.CACHE_IDS[1]  # "ipc": an exported cache, not a payload segment
            name = f"{arena.SEG_PREFIX}{os.getpid()}_{self.tag}_{kind}{uuid.uuid4().hex[:14]}"
            head = np.zeros(arena.SLOT_WORDS, dtype="<u8")
            head[[W_OWNER, W_BEAT, W_PIDNS]] = (self.producer.instance, now_ms(), owner_ident())
            fd = arena._create_file(name, arena.DATA_OFFSET, head.tobytes())
            try:
                mm = mmap.mmap(fd, arena.DATA_OFFSET, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self._owner_seg = arena.Segment(name, 0, mm)
            self.producer.adopt(self._owner_seg)
            self.owner_name = name
        return self._owner_seg.name

    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        if not caches or caches[0].device.type != "cuda":
            return None
        storage = caches[0].untyped_storage()
        if any(c.untyped_storage().data_ptr() != storage.data_ptr() for c in caches):
            return None  # not one allocation (vLLM's allocate_kv_cache makes one)
        base, nbytes = storage.data_ptr(), storage.nbytes()
        if layer_geometry(caches, base, nbytes) is None:
            return None
        try:
            shared = storage._share_cuda_()
        except RuntimeError as e:
            raise ConfigError(
                f"cuda_ipc: the KV cache cannot be exported through CUDA IPC ({e}); it must "
                "be a plain cudaMalloc allocation: do not enable vLLM sleep mode or "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with this backend"
            ) from e
        desc: dict[str, Any] = {
            "kind": self.kind,
            "uuid": device_uuid(caches[0].device.index or 0),
            "owner": self.producer.instance,
            "name": self.owner_segment(),
            "generation": self.generation,
        }
        desc.update(zip(_SHARE_FIELDS, shared[1:], strict=True))
        logger.info(
            "KV cache (%.1f MiB on %s) exported through CUDA IPC: consumers on this host "
            "copy its pages device to device",
            nbytes / 2**20,
            caches[0].device,
        )
        return desc, base, nbytes

    # -- consumer ------------------------------------------------------------------------
    def _use(self, descriptor: Any, device: torch.device) -> Mapping:
        """The mapping of the producer's allocation ``descriptor`` names, opened on local
        ``device``; in use until ``self._mappings.done``. ``KVTransferError`` when the
        producer is gone (its mappings are dropped then)."""
        if not isinstance(descriptor, dict) or descriptor.get("kind") != self.kind:
            raise KVPayloadError(f"not a CUDA IPC cache region: {descriptor!r}")
        try:
            fields = [descriptor[f] for f in _SHARE_FIELDS]
            owner, name = int(descriptor["owner"]), str(descriptor["name"])
            key = (owner, bytes(fields[0]), int(fields[2]), str(device))
        except (KeyError, TypeError, ValueError):
            raise KVPayloadError("CUDA IPC region descriptor is incomplete") from None
        if not name.startswith(arena.SEG_PREFIX) or "/" in name:
            raise KVPayloadError(f"CUDA IPC region names no producer segment: {name!r}")
        self._mappings.sweep()  # other producers that died meanwhile
        try:
            words = self._check_alive(name, owner)
        except KVTransferError:
            self._mappings.drop_owners({owner})
            raise
        check_generation(descriptor, words[1])  # the producer slept since: refused
        return self._mappings.use(key, owner, name, device, fields)

    def attach(self, descriptor: Any) -> torch.Tensor:
        """The producer's allocation, opened on this thread's current CUDA device."""
        device = torch.device("cuda", torch.cuda.current_device())
        mapping = self._use(descriptor, device)
        streams = streams_of(device)
        self._mappings.done(mapping, None if streams is None else mark(streams, device))
        return mapping.view

    def copy_all(self, descriptor: Any, copies: Sequence[PageCopy], wait: bool = False) -> int:
        """Copy pages out of the producer's allocation, opened on the device of the local
        caches (this consumer's), into them: the producer's liveness checked once, one
        plan, one device move (``wait``: waited for); the mapping stays in use until an
        event after it."""
        if not copies:
            return 0
        device = copies[0].caches[0].device
        mapping = self._use(descriptor, device)
        last: DeviceEvent | None = None
        try:
            parts: list[Part] = []
            for c in copies:
                vkey = (repr(c.geometry), c.ident, c.caches[0].dtype)
                src = mapping.pages.get(vkey)
                if src is None:
                    layers = attach_layers(mapping.view, c.geometry, c.ident, c.caches[0].dtype)
                    src = mapping.pages[vkey] = [page_view(v, c.ident) for v in layers]
                dst = [page_view(x, c.ident) for x in c.caches]
                parts.append((src, dst, c.pairs, c.sums, c.first))
            moved = move(MovePlan.stacked(parts), wait)
            streams = streams_of(device)
            last = None if streams is None else mark(streams, device)
            return moved
        finally:
            self._mappings.done(mapping, last)

    def mapped_producers(self) -> set[int]:
        """The producers (instance ids) this consumer holds open handles of."""
        return self._mappings.owners()

    def drop_dead_producers(self) -> int:
        """Close the handles of producers that are gone, except any whose copies may still
        run; returns how many were closed. Each copy does it too (at most once per
        ``HEARTBEAT_S``)."""
        return self._mappings.sweep(force=True)

    def _alive(self, name: str, owner: int) -> bool:
        try:
            self._check_alive(name, owner)
        except KVTransferError:
            return False
        return True

    def _check_alive(self, name: str, owner: int) -> list[int]:
        """The header of the producer's owner segment; ``KVTransferError`` unless alive."""
        try:
            words = arena.read_header(name)
        except FileNotFoundError:
            words = None
        if words is None or words[W_OWNER] != owner:
            raise KVTransferError(f"the producer of CUDA IPC cache {name} is gone")
        if not owner_alive(words, arena._owner_pid(name), self.stale_s):
            raise KVTransferError(
                f"the producer of CUDA IPC cache {name} is not alive (its process exited, or "
                f"in another PID namespace its heartbeat is over {self.stale_s:g}s old)"
            )
        return words

    # -- sleep mode ----------------------------------------------------------------------
    def _withdraw(self) -> None:
        self._publish_generation()
        self.void_holds()
        # consumer: release the producers' IPC handles (its copies completed: vLLM's sleep
        # waits for the loads, and each load synchronizes before it releases its hold)
        self._mappings.clear()

    def _restore(self) -> None:
        self._publish_generation()

    def _publish_generation(self) -> None:
        """Producer: the owner segment's header names the generation consumers check."""
        if self._owner_seg is not None:
            self._owner_seg.set_state(self._owner_seg.state()[0], self.generation)

    def close(self) -> None:
        self.close_holds()
        self._views = {}
        self._mappings.clear()  # drops the consumer's references to opened handles
        with contextlib.suppress(Exception):
            if self._pool is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        # the owner segment is the arena's to unlink (adopted)
