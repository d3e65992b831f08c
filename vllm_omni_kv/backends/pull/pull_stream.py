"""Receive streams of the pull connector: ranged engine reads into a local pool block.

:class:`PullFrameStream` pulls a frame's prelude, header and digest trailer when
it opens, then ``load(spans)`` pulls only the chunk-aligned byte ranges covering
``spans`` (one engine read per merged range) and verifies each chunk before it is
handed out (xxh3 digests of frames packed on the host, linear digests of frames packed
on a device; a frame without digests is refused unless the receiver sets
``require_digests: false``). ``moved`` counts the bytes pulled. The local block is sized for the
whole frame and freed once the stream is closed and no tensor view of ``obj``
(and no engine read still running into it) remains. :class:`RawPullStream` pulls
a raw buffer (a tensor or bytes put on the fast path) in one read.

Each stream holds its sender's lease from open to close: the load's end (or
``close``) releases it; a failed load releases it as unsuccessful so that the
sender keeps the block for a retry.

Engine reads run on the connector's pull threads, each bound first to the CUDA
device the reads touch (:attr:`Puller.device`: a device pool's or registered
cache's, else the device of the thread asking): engines move device memory with the
calling thread's current device and context (UCX's CUDA transports need one;
Mooncake otherwise bounces every rank's reads through device 0).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.pull.page_reads import PageReads
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout
from vllm_omni_kv.kvcache.device_order import bind_device, cuda_device_in_use
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import ALL_READY, ChunkedStream, PayloadStream, Span, check_cancel

#: a frame at most this large is pulled in one read when its stream opens
SMALL_FRAME = 64 << 10
#: the first read of a larger frame: prelude and (usually all of) the header
HEAD_PULL = 16 << 10
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


class PullFailed(KVTransferError):
    """An engine read failed, or the sender freed the block during the pull."""


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
        on_abandon: Callable[[], None] | None = None,
        track: list[cf.Future[None]] | None = None,
    ) -> None:
        """``track``: the read's future is appended to it (to wait for abandoned reads)."""
        self._bounded(
            (_engine_read, self.read_device(), self.engine, session, local, remote, n, keep),
            session,
            n,
            deadline,
            cancel,
            what,
            on_abandon,
            track,
        )

    def read_many(
        self,
        session: str,
        reads: list[tuple[int, int, int]],
        deadline: float,
        *,
        what: str,
        keep: Any = None,
        track: list[cf.Future[None]] | None = None,
    ) -> None:
        """``(local, remote, bytes)`` reads from one session as one bounded transfer."""
        n = sum(r[2] for r in reads)
        call = (_engine_read_many, self.read_device(), self.engine, session, reads, keep)
        self._bounded(call, session, n, deadline, None, what, None, track)

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
        self._bounded(call, session, reads.nbytes, deadline, None, what, None, track)

    def _bounded(
        self,
        call: tuple[Any, ...],
        session: str,
        n: int,
        deadline: float,
        cancel: threading.Event | None,
        what: str,
        on_abandon: Callable[[], None] | None,
        track: list[cf.Future[None]] | None,
    ) -> None:
        try:
            fut = self.executor.submit(*call)
        except RuntimeError:
            raise KVTransferError("the connector is closed; create a new one") from None
        if track is not None:
            track.append(fut)
        limit = min(deadline, time.monotonic() + self.timeout_s)
        while True:
            now = time.monotonic()
            try:
                wait = limit - now if cancel is None else min(CANCEL_POLL_S, limit - now)
                fut.result(timeout=max(0.0, wait))
                return
            except cf.TimeoutError:
                pass
            except Exception as e:
                # the future holds ``e``, whose traceback holds this frame (and ``keep``):
                # drop it so the destination is freed by reference counting, not a GC cycle
                del fut
                raise PullFailed(f"pull of {what} ({n} bytes) from {session} failed: {e}") from None
            cancelled = cancel is not None and cancel.is_set()
            if cancelled or time.monotonic() >= limit:
                if on_abandon is not None:
                    fut.add_done_callback(lambda _f: on_abandon())
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


class Lease:
    """The sender's hold on a block for one receiver; ``end`` tells the sender once.
    With a ``book`` it is listed there under ``key`` (and this thread) until it ends."""

    def __init__(
        self, end: Callable[[bool], bool], book: LeaseBook | None = None, key: str = ""
    ) -> None:
        self._end = end
        self.ended = False
        self._book = book
        self._slot = (key, threading.get_ident())
        if book is not None:
            book.add(self._slot, self)

    def end(self, success: bool) -> bool:
        """Release it; True when the block stayed live for the whole pull."""
        if self.ended:
            return True
        self.ended = True
        if self._book is not None:
            self._book.drop(self._slot, self)
        return self._end(success)


class LeaseBook:
    """The leases of a receiver's open streams, by key and opening thread: a cache region
    ends the lease of the payload whose stream is open while it copies pages (the
    stream is opened and its plan applied on one load thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], Lease] = {}

    def add(self, slot: tuple[str, int], lease: Lease) -> None:
        with self._lock:
            self._open[slot] = lease

    def drop(self, slot: tuple[str, int], lease: Lease) -> None:
        with self._lock:
            if self._open.get(slot) is lease:
                del self._open[slot]

    def current(self, key: str) -> Lease | None:
        """The live lease on ``key`` of a stream this thread opened, if any."""
        with self._lock:
            return self._open.get((key, threading.get_ident()))


class PullFrameStream(ChunkedStream):
    """A frame pulled range by range into ``local`` (a host pool block)."""

    def __init__(
        self,
        puller: Puller,
        session: str,
        src_addr: int,
        size: int,
        local: ManagedBuffer,
        lease: Lease,
        *,
        what: str,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> None:
        self._puller, self._session, self._src, self._lease = puller, session, src_addr, lease
        self._what, self._local = what, local
        self._reads: list[cf.Future[None]] = []  # engine reads into ``local``
        self._completed = False  # a load or copy_into reached its end
        self._releasing = False  # _release_when_idle ran
        view = (ctypes.c_char * size).from_address(local.address)
        weakref.finalize(view, local.release)  # with the last view (and the last engine read)
        self._view: Any = view
        self.frame_address = self._base = local.address
        self.size = size
        try:
            mv = memoryview(view).cast("B")
            self._mv = mv
            have = size if size <= SMALL_FRAME else min(size, HEAD_PULL)
            self._pull(0, have, deadline, cancel)
            p = codec.read_prelude(mv, size)
            if p.data_start > have:
                self._pull(have, p.data_start, deadline, cancel)
                have = p.data_start
            if p.total > have:
                self._pull(max(have, p.trailer_start), p.total, deadline, cancel)
            self._whole = have >= p.total
            info = codec.parse(mv, size, verify_head=True, require_checksum=puller.require_digests)
            self._start(mv, info, verify=True, deadline=deadline, cancel=cancel)
        except BaseException:
            self._lease.end(False)
            self.close()  # frees the block once no read into it runs
            raise

    def _release_when_idle(self) -> None:
        """Free the receive block of a stream that failed to open, or closed without a
        completed load (nothing of it is used then), once the last engine read into it has
        ended. Waiting for the last view would hold it for as long as the failed read's
        traceback lives (a reference cycle: seen holding a killed producer's frame until
        the pool ran out, at open and mid-load)."""
        if self._releasing:
            return
        self._releasing = True
        reads, self._reads = self._reads, []
        when_reads_end(reads, self._local.release)

    def _pull(self, start: int, end: int, deadline: float, cancel: threading.Event | None) -> None:
        if end <= start:
            return
        self._reads = [f for f in self._reads if not f.done()]
        self._puller.read(
            self._session,
            self._base + start,
            self._src + start,
            end - start,
            deadline,
            cancel,
            what=self._what,
            keep=self._view,
            track=self._reads,
        )
        self.moved += end - start

    def _wait(
        self, start: int, need: int, end: int, deadline: float, cancel: threading.Event | None
    ) -> int:
        if not self._whole:
            self._pull(start, end, deadline, cancel)
        return end

    def _failed(self) -> None:
        self._lease.end(False)  # the sender keeps the block for a retry

    def _finish(self, deadline: float, cancel: threading.Event | None) -> None:
        if not self._lease.end(True):
            raise PullFailed(
                f"{self._what} expired or was cleaned up on the sender during the pull"
            )
        self._completed = True

    def close(self) -> None:
        self._lease.end(True)
        super().close()
        self._view = None
        if not self._completed:  # failed or never loaded: its views are not used
            self._release_when_idle()


class RawPullStream(PayloadStream):
    """A raw buffer (or a frame in a device pool) pulled in one read by ``load``; a frame
    is verified on the pool's device (:func:`~vllm_omni_kv.wire.unpack.decode_tensor`).

    ``obj`` is the pulled :class:`ManagedBuffer` (the caller releases it), or for a
    frame in a device pool the decoded object; ``frame_address`` is None.
    """

    def __init__(
        self,
        puller: Puller,
        session: str,
        src_addr: int,
        size: int,
        local: ManagedBuffer,
        lease: Lease,
        *,
        what: str,
        frame: bool = False,
    ) -> None:
        self._puller, self._session, self._src, self._lease = puller, session, src_addr, lease
        self._local, self._what, self._frame = local, what, frame
        self.size = size
        self.obj = None if frame else local
        self._loaded = self._started = self._in_flight = False

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        if self._started:
            raise KVTransferError("a stream's load() / ready() can be iterated only once")
        self._started = True
        check_cancel(cancel, "the load")
        try:
            if self.size:
                self._puller.read(
                    self._session,
                    self._local.address,
                    self._src,
                    self.size,
                    deadline,
                    cancel,
                    what=self._what,
                    on_abandon=self._local.release,
                )
            self.moved = self.size
        except BaseException as e:
            self._in_flight = isinstance(e, KVTransferTimeout)  # released when the read ends
            self._lease.end(False)
            raise
        if not self._lease.end(True):
            raise PullFailed(
                f"{self._what} expired or was cleaned up on the sender during the pull"
            )
        if self._frame:  # a device pool: decode a private copy (no ranged reads on devices)
            try:
                frame = self._local.tensor[: self.size].clone()
                self.obj = codec.decode_tensor(frame, require_digests=self._puller.require_digests)
            finally:
                self._local.release()
        self._loaded = True
        yield ALL_READY

    def close(self) -> None:
        self._lease.end(True)
        if not self._loaded and not self._in_flight:
            self._local.release()  # never handed out
        self.obj = None
