"""Page-locking host memory we did not allocate through torch (``cudaHostRegister``).

Copies between a GPU and pageable memory are staged by the driver through a small
pinned bounce buffer and run synchronously; registered memory is copied by DMA,
asynchronously on a stream. Shared-memory segments are registered once when they
are mapped in a process that uses CUDA, and unregistered before they are unmapped.
Nothing happens in a process that has not initialized CUDA (CPU engines, tools).
"""

from __future__ import annotations

import threading

import torch

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

_warned = threading.Event()


class HostPin:
    """One registered range; :meth:`release` unregisters it (idempotent)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self._live = True

    def release(self) -> None:
        if not self._live:
            return
        self._live = False
        err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
        if int(err) != 0:
            logger.warning("cudaHostUnregister(%#x) failed (CUDA error %d)", self.ptr, int(err))


def cuda_in_use() -> bool:
    """Whether this process already initialized CUDA (registration would not create a
    context in a process that never uses the GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def register(ptr: int, nbytes: int) -> HostPin | None:
    """Register ``nbytes`` at ``ptr`` with CUDA; None when CUDA is not in use or the
    driver refuses (copies then still work, synchronously; logged once)."""
    if nbytes <= 0 or not cuda_in_use():
        return None
    # cudaHostRegisterPortable: pinned for every CUDA context of this process
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)
    if int(err) != 0:
        if not _warned.is_set():
            _warned.set()
            logger.warning(
                "cudaHostRegister of %d bytes of shared memory failed (CUDA error %d): KV "
                "copies to and from it stay synchronous. Raise the locked-memory limit "
                "(ulimit -l / the container's memlock) to pin it.",
                nbytes,
                int(err),
            )
        return None
    return HostPin(ptr, nbytes)
