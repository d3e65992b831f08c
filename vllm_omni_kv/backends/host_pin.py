"""Page-locking host memory we did not allocate through torch (``cudaHostRegister``).

Copies between a GPU and pageable memory are staged by the driver through a small
pinned bounce buffer and run synchronously; registered memory is copied by DMA,
asynchronously on a stream. Nothing is registered in a process that has not initialized
CUDA (CPU engines, tools). The CUDA calls go through :class:`PinOps` (:class:`CudaPinOps`
here; tests record them instead). Registering costs about 0.6 s per GiB, so request paths
do not call :func:`register`: the memory's owner asks :mod:`~vllm_omni_kv.backends.pinner`
to register it in the background.

torch's ``cudart`` wrappers return the runtime's error without clearing it: a failed
register or unregister would stay pending in the calling thread, and the next kernel
launch there (torch checks every launch with ``cudaGetLastError``) would raise it. Each
failure here is therefore followed by ``cudaGetLastError`` in the same thread.

A failure is logged once per operation and CUDA error (a later, different error is logged
too), naming the error's number and name; only an allocation failure
(``cudaErrorMemoryAllocation``) asks for a larger locked-memory limit. Registering a range
that a live registration of ours already covers is no error: the range is pinned already.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Protocol

import torch

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

MEMORY_ALLOCATION, ALREADY_REGISTERED, NOT_REGISTERED = 2, 712, 713
#: the CUDA runtime's names of the errors registration returns (``cudaError_t``)
CUDA_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    ALREADY_REGISTERED: "cudaErrorHostMemoryAlreadyRegistered",
    NOT_REGISTERED: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}


class PinOps(Protocol):
    """The CUDA calls registration makes."""

    def device(self) -> int | None:
        """The calling thread's CUDA device when this process uses CUDA; None: register nothing."""
        ...

    def register(self, ptr: int, nbytes: int, device: int) -> int:
        """``cudaHostRegister`` (portable) of the range on ``device``; its CUDA error (0: ok)."""
        ...

    def unregister(self, ptr: int, device: int) -> int:
        """``cudaHostUnregister`` of the range starting at ``ptr``; its CUDA error (0: ok)."""
        ...


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
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
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


def cuda_error_name(code: int) -> str:
    """The CUDA runtime's name of error ``code``."""
    if code in CUDA_ERROR_NAMES:
        return CUDA_ERROR_NAMES[code]
    lib = _cudart() if torch.version.cuda else None
    name = lib.cudaGetErrorName(code) if lib is not None else None
    return name.decode() if name else "an unknown CUDA error"


def cuda_in_use() -> bool:
    """Whether this process already initialized CUDA (registration would not create a
    context in a process that never uses the GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class CudaPinOps:
    """:class:`PinOps` through torch's CUDA runtime; each failure's error is cleared."""

    def device(self) -> int | None:
        return torch.cuda.current_device() if cuda_in_use() else None

    def register(self, ptr: int, nbytes: int, device: int) -> int:
        with torch.cuda.device(device):  # a background thread starts on device 0
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: portable
        if err:
            clear_cuda_error()
        return err

    def unregister(self, ptr: int, device: int) -> int:
        with torch.cuda.device(device):
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err:
            clear_cuda_error()
        return err


def failure_message(op: str, code: int, nbytes: int) -> str:
    """What a failed ``op`` (``cudaHostRegister`` / ``cudaHostUnregister``) of ``nbytes``
    means, and what to do."""
    what = (
        f"{op} of {nbytes} bytes of host memory failed (CUDA error {code} {cuda_error_name(code)})"
    )
    if code == MEMORY_ALLOCATION:
        return (
            f"{what}: the driver could not lock the pages. KV copies to and from them stay "
            "synchronous; raise the locked-memory limit (ulimit -l / the container's memlock) "
            "to pin them"
        )
    if code == ALREADY_REGISTERED:
        return (
            f"{what}: other code in this process registered part of the range already. KV "
            "copies use that registration where it covers them and stay synchronous elsewhere; "
            "nothing to change unless they are slow"
        )
    if code == NOT_REGISTERED:
        return f"{what}: the range was no longer registered (nothing else to undo)"
    return (
        f"{what}. KV copies to and from it stay synchronous (correct, slower); check the "
        "driver (nvidia-smi) if it persists"
    )


_reported: set[tuple[str, int]] = set()
_live: dict[int, int] = {}  # start -> end of each registration of ours, until released
_lock = threading.Lock()


def _report(op: str, code: int, nbytes: int) -> None:
    """Log a failure once per operation and CUDA error."""
    with _lock:
        first = (op, code) not in _reported
        _reported.add((op, code))
    if first:
        logger.warning("%s", failure_message(op, code, nbytes))
    else:
        logger.debug("%s", failure_message(op, code, nbytes))


def _covered(ptr: int, nbytes: int) -> bool:
    with _lock:
        return any(s <= ptr and ptr + nbytes <= e for s, e in _live.items())


class HostPin:
    """One registered range; :meth:`release` unregisters it (idempotent). A pin that
    does not ``own`` its range (it lies inside another pin of ours) releases nothing."""

    def __init__(self, ptr: int, nbytes: int, ops: PinOps, device: int, owned: bool) -> None:
        self.ptr, self.nbytes, self.owned = ptr, nbytes, owned
        self._ops, self._device = ops, device
        self._live = True

    def release(self) -> None:
        if not self._live:
            return
        self._live = False
        if not self.owned:
            return
        with _lock:
            _live.pop(self.ptr, None)
        err = self._ops.unregister(self.ptr, self._device)
        if err:
            _report("cudaHostUnregister", err, self.nbytes)


def register(
    ptr: int, nbytes: int, ops: PinOps | None = None, device: int | None = None
) -> HostPin | None:
    """Register ``nbytes`` at ``ptr`` now (seconds per several GiB: not on a request path);
    None when CUDA is not in use or the driver refuses (copies then still work,
    synchronously; logged once per error). ``device``: the CUDA device to register on
    (default: the calling thread's)."""
    ops = ops if ops is not None else CudaPinOps()
    dev = ops.device() if device is None else device
    if nbytes <= 0 or dev is None:
        return None
    if _covered(ptr, nbytes):  # ours already: pinned
        return HostPin(ptr, nbytes, ops, dev, owned=False)
    err = ops.register(ptr, nbytes, dev)
    if err == ALREADY_REGISTERED and _covered(ptr, nbytes):  # ours, registered meanwhile
        return HostPin(ptr, nbytes, ops, dev, owned=False)
    if err:
        _report("cudaHostRegister", err, nbytes)
        return None
    with _lock:
        _live[ptr] = ptr + nbytes
    return HostPin(ptr, nbytes, ops, dev, owned=True)
