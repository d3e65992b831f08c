"""Engine reads of the pull connector, on its thread pool and bounded.

:class:`Puller` runs each engine read (one range, several ranges as one batch, or one
move's pages out of a registered cache) on the connector's pull threads, bounded by a
timeout and a cancel event; a stalled read is abandoned and keeps its destination alive
until it ends (:func:`when_reads_end`), and so does a transfer an engine gave up on but
cannot stop (:class:`ReadStillRunning`: its pull thread is free meanwhile). Each thread
is bound first to the CUDA device the reads touch (:attr:`Puller.device`: a device
pool's or registered cache's, else the device of the thread asking): engines move device
memory with the calling thread's current device and context (UCX's CUDA transports need
one; Mooncake otherwise bounces every rank's reads through device 0).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from vllm_omni_kv.backends.pull.page_reads import PageReads
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout
from vllm_omni_kv.kvcache.device_order import bind_device, cuda_device_in_use
from vllm_omni_kv.wire.stream import check_cancel

#: how often a waiting load checks its cancel event (seconds)
CANCEL_POLL_S = 0.001


class EngineAdapter(Protocol):
    """The few engine operations the connector needs. Optional, where the engine has
    them: ``read_many(session, reads)`` (``(local, remote, bytes)`` reads as one batched
    transfer), ``read_pages(session, reads)`` (one move's
    :class:`~.page_reads.PageReads` as one transfer by index into prepared descriptor
    lists), ``register_device(addr, size, device)`` (memory of a torch device, e.g. a
    CUDA KV cache; :mod:`.cache_region`) and ``transport()`` (what carries the reads: a
    protocol, or transports, for logs and metrics)."""

    session: str  # "host:rpc_port" that peers pass as target_hostname

    def register(self, addr: int, size: int) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def read(self, session: str, local_addr: int, remote_addr: int, length: int) -> None: ...
    def close(self) -> None: ...


def register_memory(
    engine: EngineAdapter, name: str, addr: int, size: int, device: torch.device
) -> None:
    """Register ``size`` bytes at ``addr`` of ``device`` with ``engine`` (the ``name``
    backend's): device memory only where the engine can move it (``register_device``)."""
    register = getattr(engine, "register_device", None)
    if register is not None:
        register(addr, size, str(device))
    elif device.type == "cpu":
        engine.register(addr, size)
    else:
        raise KVTransferError(
            f"the {name} engine cannot move {device} memory: use host memory "
            "(memory_pool_device: cpu)"
        )


class PullFailed(KVTransferError):
    """An engine read failed, or the sender freed the block during the pull."""


class ReadStillRunning(KVTransferError):
    """An engine read gave up while its transfer may still write into the destination:
    ``ended`` completes once no byte of it can land any more (the destination is kept
    until then, without holding a pull thread). Not a ``TimeoutError``: futures' waits
    take those for "not done"."""

    def __init__(self, message: str, ended: cf.Future[None]) -> None:
        super().__init__(message)
        self.ended = ended


def _landed(ended: cf.Future[None], _pin: tuple[Any, ...], _later: cf.Future[None]) -> None:
    ended.set_result(None)


def _never_ran(ended: cf.Future[None], fut: cf.Future[None]) -> None:
    if fut.cancelled():  # the executor shut down before the read started
        ended.set_result(None)


def _run_read(ended: cf.Future[None], fn: Callable[..., None], *args: Any) -> None:
    """Run one engine read on a pull thread; ``ended`` completes once no byte of it can
    land: when it returns or raises, or for a :class:`ReadStillRunning`, when that
    transfer ends (``args``, which pin the destination, are held until then)."""
    later: cf.Future[None] | None = None
    try:
        fn(*args)
    except ReadStillRunning as e:
        later = e.ended
        raise
    finally:
        if later is None:
            ended.set_result(None)
        else:
            later.add_done_callback(partial(_landed, ended, args))


def _engine_read(
    device: torch.device | None,
    engine: EngineAdapter,
    session: str,
    local: int,
    remote: int,
    n: int,
    _keep: Any,
) -> None:
    bind_device(device)
    engine.read(session, local, remote, n)  # ``_keep`` pins the destination until it ends


def _engine_read_many(
    device: torch.device | None,
    engine: EngineAdapter,
    session: str,
    reads: list[tuple[int, int, int]],
    _keep: Any,
) -> None:
    bind_device(device)
    many = getattr(engine, "read_many", None)  # one batched transfer where the engine has it
    if many is not None:
        many(session, reads)
        return
    for local, remote, n in reads:
        engine.read(session, local, remote, n)


def _engine_read_pages(
    device: torch.device | None,
    engine: EngineAdapter,
    session: str,
    reads: PageReads,
    _keep: Any,
) -> None:
    bind_device(device)
    pages = getattr(engine, "read_pages", None)  # prepared descriptor lists (NIXL)
    if pages is not None:
        pages(session, reads)
    else:
        _engine_read_many(device, engine, session, reads.ranges(), _keep)


class Puller:
    """Engine reads on a thread pool, each bounded by a timeout and a cancel event; a
    stalled read is abandoned (it keeps its destination alive until it ends).

    ``require_digests`` (the receiver's setting): streams refuse frames without chunk
    digests, whatever the sender's ``frame_checksum``.
    """

    def __init__(
        self,
        engine: EngineAdapter,
        executor: cf.ThreadPoolExecutor,
        timeout_s: float,
        require_digests: bool = True,
    ):
        self.engine, self.executor, self.timeout_s = engine, executor, timeout_s
        self.require_digests = require_digests
        #: the device the reads touch (a device pool, a registered CUDA cache); None: the
        #: CUDA device of the thread asking for a read, where this process uses CUDA
        self.device: torch.device | None = None

    def read_device(self) -> torch.device | None:
        """The device a pull thread binds before its next read."""
        return self.device if self.device is not None else cuda_device_in_use()

    def read(
        self,
        session: str,
        local: int,
        remote: int,
        n: int,
        deadline: float,
        cancel: threading.Event | None,
        *,
        what: str,
        keep: Any = None,
        track: list[cf.Future[None]] | None = None,
    ) -> None:
        """``track``: a future that completes once no byte of the read can land any more
        is appended to it; a destination is given back once it is done
        (:func:`when_reads_end`), also after the read was abandoned."""
        call = (_engine_read, self.read_device(), self.engine, session, local, remote, n, keep)
        self._bounded(call, session, n, deadline, cancel, what, track)

    def read_many(
        self,
        session: str,
        reads: list[tuple[int, int, int]],
        deadline: float,
        *,
        cancel: threading.Event | None = None,
        what: str,
        keep: Any = None,
        track: list[cf.Future[None]] | None = None,
    ) -> None:
        """``(local, remote, bytes)`` reads from one session as one bounded transfer."""
        n = sum(r[2] for r in reads)
        call = (_engine_read_many, self.read_device(), self.engine, session, reads, keep)
        self._bounded(call, session, n, deadline, cancel, what, track)

    def read_pages(
        self,
        session: str,
        reads: PageReads,
        deadline: float,
        *,
        what: str,
        keep: Any = None,
        track: list[cf.Future[None]] | None = None,
    ) -> None:
        """One move's page reads from one session as one bounded transfer."""
        call = (_engine_read_pages, self.read_device(), self.engine, session, reads, keep)
        self._bounded(call, session, reads.nbytes, deadline, None, what, track)

    def _bounded(
        self,
        call: tuple[Any, ...],
        session: str,
        n: int,
        deadline: float,
        cancel: threading.Event | None,
        what: str,
        track: list[cf.Future[None]] | None,
    ) -> None:
        ended: cf.Future[None] = cf.Future()
        try:
            fut = self.executor.submit(_run_read, ended, *call)
        except RuntimeError:
            raise KVTransferError("the connector is closed; create a new one") from None
        fut.add_done_callback(partial(_never_ran, ended))
        if track is not None:
            track.append(ended)
        limit = min(deadline, time.monotonic() + self.timeout_s)
        while True:
            now = time.monotonic()
            wait = limit - now if cancel is None else min(CANCEL_POLL_S, limit - now)
            # cf.wait, not fut.result: a read that raised a TimeoutError of its own ended,
            # and must not be taken for one still running
            if cf.wait([fut], timeout=max(0.0, wait)).done:
                if fut.cancelled():
                    raise KVTransferError("the connector is closed; create a new one")
                err = fut.exception()
                if err is None:
                    return
                why = str(err)
                # the future holds ``err``, whose traceback holds the read's frame (and
                # ``keep``): drop both so the destination is freed by reference counting
                del fut, err
                raise PullFailed(f"pull of {what} ({n} bytes) from {session} failed: {why}")
            cancelled = cancel is not None and cancel.is_set()
            if cancelled or time.monotonic() >= limit:
                check_cancel(cancel, f"the pull of {what}")
                raise KVTransferTimeout(
                    f"pull of {what} ({n} bytes) from {session} stalled past "
                    f"transfer_timeout_s={self.timeout_s:.1f}s or the load's deadline"
                )


def when_reads_end(reads: list[cf.Future[None]], then: Callable[[], None]) -> None:
    """Call ``then`` once none of ``reads`` runs any more (at once when none does)."""
    pending = [f for f in reads if not f.done()]
    if not pending:
        then()
        return
    left, lock = [len(pending)], threading.Lock()

    def ended(_f: cf.Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in pending:
        f.add_done_callback(ended)
