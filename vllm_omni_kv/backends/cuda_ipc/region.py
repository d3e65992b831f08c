"""The producer's CUDA KV cache exported through CUDA IPC, with hold files on its blocks.

Producer: vLLM allocates the KV cache inside :meth:`CudaIpcRegion.allocation_context`, a
private ``torch.cuda.MemPool``, so the cache is a ``cudaMalloc`` allocation of its own
that CUDA IPC can export (vLLM's sleep-mode allocator and expandable segments cannot
be). :meth:`export` shares the cache's storage once (``_share_cuda_``: an IPC handle of
the allocation, the storage's offset in it) and names the device by UUID, since
``CUDA_VISIBLE_DEVICES`` may number devices differently in the consumer. A payload is
block ids (:mod:`vllm_omni_kv.kvcache.shared_pages`); the producer synchronizes its
stream before publishing one, so the pages are final when a consumer reads them.
:meth:`~CudaIpcRegion.check_placement` verifies that every layer view lies in one of the
pool's segments (``MemPool.snapshot``).

Consumer: opens the handle once per producer (``_new_shared_cuda``) and copies the pages
it lacks device to device (peer to peer between two GPUs), then synchronizes before it
releases the hold. Holds and liveness are the shared-memory ones
(:class:`~vllm_omni_kv.backends.shm.cache_region.HoldFiles`): a small heartbeat segment
``omnikv_seg_<pid>_<ns>_ipc<id>`` stands for the producer, so a dead producer's holds are
swept and a consumer refuses a handle whose owner stopped beating.

None of this has run on a GPU in this project's CI (no GPU there); ``make gpu-check``
runs its tests on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.cache_region import HoldFiles
from vllm_omni_kv.backends.shm.liveness import (
    W_BEAT,
    W_OWNER,
    W_PIDNS,
    now_ms,
    owner_alive,
    pid_namespace,
)
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.shared_pages import layer_geometry
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


def local_device(uuid_str: Any) -> int:
    """This process's index of the GPU with UUID ``uuid_str``; ``KVTransferError`` if unseen."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid_str:
            return i
    raise KVTransferError(
        f"the producer's GPU {uuid_str} is not visible to this process: CUDA IPC needs both "
        "GPUs visible (include it in CUDA_VISIBLE_DEVICES) and on one host; otherwise use "
        "the nixl or mooncake backend"
    )


class CudaIpcRegion(HoldFiles, CacheRegion):
    """A CUDA KV cache shared through CUDA IPC (producer) / opened handles (consumer)."""

    kind = "cuda_ipc"
    digests = False  # hashing device pages would need a device-to-host copy
    places = "cuda"
    off_switch = "use backend 'shm' without share_cache instead (packed payloads)"

    def __init__(self, namespace: str, producer: ProducerArena, stale_s: float) -> None:
        super().__init__(namespace)
        self.producer = producer
        self.stale_s = stale_s
        self._pool: Any = None
        self._entered = False
        self._owner_seg: arena.Segment | None = None
        self._opened: dict[tuple[int, bytes, int], torch.Tensor] = {}  # consumer side
        self._lock = threading.Lock()

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

    def _owner(self) -> str:
        """The heartbeat segment standing for this producer (created once)."""
        if self._owner_seg is None:
            name = f"{arena.SEG_PREFIX}{os.getpid()}_{self.tag}_ipc{uuid.uuid4().hex[:14]}"
            head = np.zeros(arena.SLOT_WORDS, dtype="<u8")
            head[[W_OWNER, W_BEAT, W_PIDNS]] = (self.producer.instance, now_ms(), pid_namespace())
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
            "name": self._owner(),
        }
        desc.update(zip(_SHARE_FIELDS, shared[1:], strict=True))
        logger.info(
            "KV cache (%.1f MiB on %s) exported through CUDA IPC: consumers on this host "
            "copy its pages device to device",
            nbytes / 2**20,
            caches[0].device,
        )
        return desc, base, nbytes

    def ready(self, caches: Sequence[torch.Tensor]) -> None:
        """The pages a payload names are final (the forward that wrote them has run)."""
        if caches and caches[0].device.type == "cuda":
            torch.cuda.current_stream(caches[0].device).synchronize()

    # -- consumer ------------------------------------------------------------------------
    def attach(self, descriptor: Any) -> torch.Tensor:
        if not isinstance(descriptor, dict) or descriptor.get("kind") != self.kind:
            raise KVPayloadError(f"not a CUDA IPC cache region: {descriptor!r}")
        try:
            fields = [descriptor[f] for f in _SHARE_FIELDS]
            owner, name = int(descriptor["owner"]), str(descriptor["name"])
        except (KeyError, TypeError, ValueError):
            raise KVPayloadError("CUDA IPC region descriptor is incomplete") from None
        if not name.startswith(arena.SEG_PREFIX) or "/" in name:
            raise KVPayloadError(f"CUDA IPC region names no producer segment: {name!r}")
        self._check_alive(name, owner)
        dev = local_device(descriptor.get("uuid"))
        key = (owner, bytes(fields[0]), int(fields[2]))
        with self._lock:
            hit = self._opened.get(key)
            if hit is not None:
                return hit
            with torch.cuda.device(dev):
                storage = torch.UntypedStorage._new_shared_cuda(dev, *fields)
                view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}")
                view.set_(storage, 0, (storage.nbytes(),), (1,))
            self._opened[key] = view
            return view

    def _check_alive(self, name: str, owner: int) -> None:
        try:
            words = arena.read_header(name)
        except FileNotFoundError:
            words = None
        if words is None or words[W_OWNER] != owner:
            raise KVTransferError(f"the producer of CUDA IPC cache {name} is gone")
        if not owner_alive(words, arena._owner_pid(name), self.stale_s):
            raise KVTransferError(
                f"the producer of CUDA IPC cache {name} is not alive (no heartbeat for "
                f"{self.stale_s:g}s)"
            )

    def close(self) -> None:
        self.close_holds()
        self._views = {}
        with self._lock:
            self._opened.clear()  # drops the consumer's references to opened handles
        with contextlib.suppress(Exception):
            if self._pool is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        # the owner segment is the arena's to unlink (adopted)
