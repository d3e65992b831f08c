"""Page-locking host memory we did not allocate through torch (``cudaHostRegister``).

Copies between a GPU and pageable memory are staged by the driver through a small
pinned bounce buffer and run synchronously; registered memory is copied by DMA,
asynchronously on a stream. Shared-memory segments are registered once when they
are mapped in a process that uses CUDA, and unregistered before they are unmapped.
Nothing happens in a process that has not initialized CUDA (CPU engines, tools).

torch's ``cudart`` wrappers return the runtime's error without clearing it: a failed
register or unregister would stay pending in the calling thread, and the next kernel
launch there (torch checks every launch with ``cudaGetLastError``) would raise it. Each
failure here is therefore followed by ``cudaGetLastError`` in the same thread.
"""

from __future__ import annotations

import ctypes
import functools
import os
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
            clear_cuda_error()
            logger.warning("cudaHostUnregister(%#x) failed (CUDA error %d)", self.ptr, int(err))


def _loaded_cudart() -> str | None:
    """The path of the CUDA runtime library this process loaded (torch's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        pass
    return None


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    major = (torch.version.cuda or "").split(".")[0]
    for name in (_loaded_cudart(), f"libcudart.so.{major}", "libcudart.so"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    logger.warning(
        "no CUDA runtime library found to clear a failed call's error: the next kernel "
        "launch in this thread may raise it"
    )
    return None


def clear_cuda_error() -> int:
    """Reset this thread's pending CUDA runtime error; return it (0: none was pending)."""
    lib = _cudart()
    return 0 if lib is None else int(lib.cudaGetLastError())


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
        clear_cuda_error()
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
