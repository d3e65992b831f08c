"""Recording :class:`~vllm_omni_kv.backends.host_pin.PinOps` for tests (no GPU needed).

:class:`RecordingPinOps` records every register / unregister call: the range, the calling
thread, and whether the kernel had the range mapped at that moment (read from
``/proc/self/maps``, not from the code under test). Without an ``inner`` implementation it
keeps the driver's bookkeeping itself: a range overlapping a registered one is refused with
712 (``cudaErrorHostMemoryAlreadyRegistered``) and unregistering an unregistered address
with 713, as ``cudaHostRegister`` / ``cudaHostUnregister`` do. With ``inner`` (e.g.
:class:`~vllm_omni_kv.backends.host_pin.CudaPinOps`) it records and forwards. A ``gate``
holds every registration until the test sets it; ``fail`` makes registrations return that
CUDA error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm_omni_kv.backends.host_pin import ALREADY_REGISTERED, NOT_REGISTERED, PinOps

__all__ = ["PinCall", "RecordingPinOps", "mapped"]


@dataclass(frozen=True)
class PinCall:
    op: str  # "register" or "unregister"
    ptr: int
    nbytes: int  # the range (unregister: the one registered at ptr)
    thread: int  # threading.get_ident() of the caller
    mapped: bool  # whether the kernel had the whole range mapped then
    code: int  # the CUDA error returned (0: ok)


def mapped(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` is mapped in this process (``/proc/self/maps``)."""
    end, at = ptr + max(nbytes, 1), ptr
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            spans.append((lo, hi))
    for lo, hi in sorted(spans):
        if lo <= at < hi:
            at = hi
            if at >= end:
                return True
    return False


class RecordingPinOps:
    """See the module docstring."""

    def __init__(
        self,
        device: int | None = 0,
        inner: PinOps | None = None,
        gate: threading.Event | None = None,
        fail: int = 0,
    ) -> None:
        self.inner, self.gate, self.fail = inner, gate, fail
        self._device = device
        self.calls: list[PinCall] = []
        self.registered: dict[int, int] = {}  # start -> nbytes (without inner)
        self._sizes: dict[int, int] = {}  # start -> nbytes of each successful registration
        self._lock = threading.Lock()
        self.entered = threading.Event()  # set when a registration call starts (before the gate)

    def device(self) -> int | None:
        return self.inner.device() if self.inner is not None else self._device

    def register(self, ptr: int, nbytes: int, device: int) -> int:
        self.entered.set()
        if self.gate is not None and not self.gate.wait(60):
            raise TimeoutError("the test never opened the registration gate")
        with self._lock:
            if self.fail:
                code = self.fail
            elif self.inner is not None:
                code = self.inner.register(ptr, nbytes, device)
            elif any(s < ptr + nbytes and ptr < s + n for s, n in self.registered.items()):
                code = ALREADY_REGISTERED
            else:
                self.registered[ptr], code = nbytes, 0
            self._record("register", ptr, nbytes, code)
            return code

    def unregister(self, ptr: int, device: int) -> int:
        with self._lock:
            size = self._sizes.get(ptr, 1)
            if self.inner is not None:
                code = self.inner.unregister(ptr, device)
            else:
                code = 0 if self.registered.pop(ptr, None) is not None else NOT_REGISTERED
            self._record("unregister", ptr, size, code)
            return code

    def _record(self, op: str, ptr: int, nbytes: int, code: int) -> None:
        """Record a call; ``nbytes``: the range whose mapping is checked."""
        if op == "register" and code == 0:
            self._sizes[ptr] = nbytes
        call = PinCall(op, ptr, nbytes, threading.get_ident(), mapped(ptr, nbytes), code)
        self.calls.append(call)

    def of(self, op: str) -> list[PinCall]:
        """The calls of ``op``, in order."""
        with self._lock:
            return [c for c in self.calls if c.op == op]
