"""Registering host memory with CUDA in the background, off every request path.

``cudaHostRegister`` costs about 35 ms per 64 MiB and 0.6 s per GiB, so whoever owns a
range of host memory (a shared-memory mapping: :mod:`~vllm_omni_kv.backends.shm.pinned_map`)
asks a :class:`Pinner` for it and goes on: one thread per pinner registers ranges in the
order asked. Until a registration lands, copies to and from the range are synchronous
(staged through the driver's bounce buffer) and correct; once it lands, they run by DMA.
The owner holds the :class:`PendingPin` and releases it before the memory goes: a release
unregisters a landed registration and cancels a queued one; one in flight is undone as soon
as it returns, and the memory is freed only after that (the releaser waits for it, or hands
the freeing to the pinner's thread), so no registration outlives its memory.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from vllm_omni_kv.backends.host_pin import CudaPinOps, HostPin, PinOps, register
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

__all__ = ["PendingPin", "Pinner", "default_pinner", "install_pinner"]

#: how long the pinner's thread waits for work before it exits (a new request starts it again)
IDLE_EXIT_S = 5.0


class PendingPin:
    """The registration of one host range, requested from a :class:`Pinner`; owned by
    the owner of the memory, which releases it before the memory is unmapped."""

    def __init__(self, ptr: int, nbytes: int, ops: PinOps, device: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self._ops, self._device = ops, device
        self._cond = threading.Condition()
        self._settled = threading.Event()  # registered, refused, or released
        self._pin: HostPin | None = None
        self._released = False
        self._runner: int | None = None  # the thread registering it right now
        self._after: list[Callable[[], None]] = []  # run once a registration in flight is undone

    @property
    def pinned(self) -> bool:
        """Whether the registration has landed (and is not released)."""
        return self._pin is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the registration landed, was refused or released; whether it settled."""
        return self._settled.wait(timeout)

    def run(self) -> None:
        """Register the range (the pinner's thread), unless it was released first."""
        with self._cond:
            if self._released:
                self._settled.set()
                return
            self._runner = threading.get_ident()
        pin: HostPin | None = None
        try:
            pin = register(self.ptr, self.nbytes, self._ops, self._device)
        finally:
            after: list[Callable[[], None]] = []
            with self._cond:
                if self._released:  # meanwhile: undone before any releaser frees the memory
                    if pin is not None:
                        pin.release()
                    after, self._after = self._after, []
                else:
                    self._pin = pin
                self._runner = None
                self._cond.notify_all()
            for then in after:
                then()
            self._settled.set()

    def release(self, then: Callable[[], None] | None = None) -> bool:
        """Undo the registration before the memory goes (idempotent). Without ``then`` it
        waits for a registration in flight; with ``then`` it returns False at once instead,
        and the pinner's thread undoes the registration, then calls ``then`` (which frees the
        memory). True: nothing is registered any more, ``then`` was not called."""
        with self._cond:
            self._released = True
            pin, self._pin = self._pin, None
            running = self._runner is not None and self._runner != threading.get_ident()
            if running and then is not None:
                self._after.append(then)
                return False
            while self._runner is not None and self._runner != threading.get_ident():
                self._cond.wait()
        if pin is not None:
            pin.release()
        self._settled.set()
        return True


class Pinner:
    """A thread that registers requested ranges in order (started on demand; it exits
    after :data:`IDLE_EXIT_S` without work)."""

    def __init__(self, ops: PinOps | None = None) -> None:
        self.ops: PinOps = ops if ops is not None else CudaPinOps()
        self._queue: queue.SimpleQueue[PendingPin] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None

    def request(self, ptr: int, nbytes: int) -> PendingPin | None:
        """Ask for ``nbytes`` at ``ptr`` to be registered; returns at once. None where
        nothing is registered (this process does not use CUDA, or an empty range)."""
        device = self.ops.device()
        if device is None or nbytes <= 0:
            return None
        pin = PendingPin(ptr, nbytes, self.ops, device)
        with self._lock:
            self._pending += 1
            self._queue.put(pin)
            if self._thread is None or not self._thread.is_alive():  # idle exit, or forked
                self._thread = threading.Thread(
                    target=self._loop, name="omnikv-host-pin", daemon=True
                )
                self._thread.start()
        return pin

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every requested registration has settled; whether they did."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _loop(self) -> None:
        while True:
            try:
                pin = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                pin.run()
            except Exception as e:  # the range stays pageable: copies stay synchronous
                logger.warning("registering %d bytes of host memory with CUDA: %s", pin.nbytes, e)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


_default: Pinner | None = None
_default_lock = threading.Lock()


def default_pinner() -> Pinner:
    """This process's pinner (CUDA), created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Pinner()
        return _default


def _forget_after_fork() -> None:
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()  # their thread and holders stayed behind


os.register_at_fork(after_in_child=_forget_after_fork)


def install_pinner(pinner: Pinner | None) -> Pinner | None:
    """Make ``pinner`` this process's pinner (None: a CUDA one on next use); returns the
    one it replaces (tests install a pinner over recording :class:`PinOps`)."""
    global _default
    with _default_lock:
        old, _default = _default, pinner
        return old
