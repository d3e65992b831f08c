"""Receive streams of the pull connector: ranged engine reads into a local pool block.

:class:`PullFrameStream` pulls a frame's prelude, header and digest trailer when it opens
(its first and last bytes, in one transfer; nothing when the sender's ``acquire`` reply
carried them, :func:`edges_of`), then ``load(spans)`` pulls only the
chunk-aligned byte ranges covering ``spans`` (one engine read per merged range; bytes
already pulled, such as the trailer's chunk or the blobs decoding needed, are not pulled
again) and verifies each chunk before it is handed out (xxh3 digests of frames packed on
the host, linear digests of frames packed on a device; a frame without digests is refused unless the receiver sets
``require_digests: false``). ``moved`` counts the bytes pulled. The local block is sized for the
whole frame and freed once the stream is closed and no tensor view of ``obj``
(and no engine read still running into it) remains. :class:`RawPullStream` pulls
a raw buffer (a tensor or bytes put on the fast path) in one read.

Each stream holds its sender's lease from open to close: the load's end (or
``close``) releases it; a failed load releases it as unsuccessful so that the
sender keeps the block for a retry.

Engine reads run on the connector's pull threads (:mod:`.puller`).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeGuard

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.pull.held_spans import HeldSpans
from vllm_omni_kv.backends.pull.puller import Puller, PullFailed, when_reads_end
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.prelude import PRELUDE_SIZE
from vllm_omni_kv.wire.stream import (
    ALL_READY,
    ChunkedStream,
    PayloadStream,
    Span,
    check_cancel,
    merge_spans,
)

#: a frame at most this large is pulled in one read when its stream opens
SMALL_FRAME = 64 << 10
#: the first read of a larger frame: prelude and (usually all of) the header
HEAD_PULL = 16 << 10
#: read with the head, in the same transfer: the frame's last bytes, which hold its digest
#: trailer (8 bytes per chunk: 4,096 chunks, 1 GiB of 256 KiB chunks; keyed frames less)
TAIL_PULL = 32 << 10


#: one past the last byte a 64-bit address names
ADDRESS_END = 1 << 64

#: the longest engine session a peer may name: a NIXL ``omnikv-<16 hex>@host:port`` with
#: a host name of 253 characters is 283, a Mooncake or Yuanrong ``host:port`` at most 259
MAX_SESSION = 320

#: frame bytes only a sender's ``acquire`` reply may carry (never a caller's metadata:
#: ``kv_transfer_params`` come from clients)
REPLY_ONLY = frozenset(("frame", "head", "tail_at", "tail"))


def inline_of(md: dict[str, Any], size: int) -> bytes | None:
    """The block's bytes as the sender's ``acquire`` reply carried them (taken out of
    ``md``): exactly ``size`` bytes, else None (the block is pulled)."""
    got = md.pop("frame", None)
    return got if type(got) is bytes and len(got) == size else None


def edges_of(md: dict[str, Any], size: int) -> tuple[bytes, int, bytes] | None:
    """``(head, tail_at, tail)``: a frame's first bytes and the bytes at ``tail_at`` as the
    sender's ``acquire`` reply carried them (taken out of ``md``), when both lie within
    ``size`` bytes and the head holds a prelude, else None (they are pulled). The frame's
    own checksum verifies them like pulled bytes."""
    head, tail_at, tail = md.pop("head", None), md.pop("tail_at", None), md.pop("tail", None)
    if type(head) is not bytes or type(tail) is not bytes or type(tail_at) is not int:
        return None
    if not PRELUDE_SIZE <= len(head) <= size or not 0 <= tail_at <= size - len(tail):
        return None
    return head, tail_at, tail


def is_session(session: Any) -> TypeGuard[str]:
    """Whether a peer's ``session`` is a non-empty string of at most :data:`MAX_SESSION`
    characters."""
    return type(session) is str and 0 < len(session) <= MAX_SESSION


def block_of(md: dict[str, Any]) -> tuple[int, int]:
    """``(data_size, src_addr)`` of a sender's block: non-negative integers that name
    64-bit addresses, at a named engine ``session`` (:func:`is_session`; the sender's reply
    is not trusted), else :class:`PullFailed`."""
    size, src, session = md.get("data_size"), md.get("src_addr"), md.get("session")
    if type(size) is not int or type(src) is not int or size < 0 or src < 0:
        raise PullFailed(f"the sender named a block of {size!r} bytes at {src!r}: not a block")
    if src + size > ADDRESS_END:
        raise PullFailed(f"the sender named a block of {size} bytes at {src:#x}: past the end")
    if not is_session(session):
        raise PullFailed(f"the sender named engine session {session!r:.80}: not a session")
    return size, src


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
    """A frame pulled range by range into ``local`` (a host pool block). ``inline``: the
    frame's bytes from the sender's ``acquire`` reply (:func:`inline_of`): nothing is
    pulled then; ``edges``: its head and trailer from that reply (:func:`edges_of`)."""

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
        inline: bytes | None = None,
        edges: tuple[bytes, int, bytes] | None = None,
    ) -> None:
        self._puller, self._session, self._src, self._lease = puller, session, src_addr, lease
        self._what, self._local = what, local
        self._reads: list[cf.Future[None]] = []  # engine reads into ``local``
        self._have = HeldSpans()  # frame bytes pulled: never pulled twice
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
            if inline is not None:  # came with the acquire reply
                self._copy_in(0, inline)
            elif edges is not None:
                self._copy_in(0, edges[0])
                self._copy_in(edges[1], edges[2])
            else:
                head = size if size <= SMALL_FRAME else min(size, HEAD_PULL)
                self._pull_ranges([(0, head), (size - TAIL_PULL, size)], deadline, cancel)
            p = codec.read_prelude(mv, size)
            self._pull_ranges([(0, p.data_start), (p.trailer_start, p.total)], deadline, cancel)
            info = codec.parse(mv, size, verify_head=True, require_checksum=puller.require_digests)
            self._start(mv, info, verify=True, deadline=deadline, cancel=cancel)
        except BaseException:
            self._lease.end(False)
            self.close()  # frees the block once no read into it runs
            raise

    def _copy_in(self, at: int, got: bytes) -> None:
        """Place frame bytes the sender's reply carried at offset ``at`` (within the block)."""
        ctypes.memmove(self._base + at, got, len(got))
        self._have.add(at, at + len(got))
        self.moved += len(got)

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

    def _pull_ranges(
        self, ranges: list[Span], deadline: float, cancel: threading.Event | None
    ) -> None:
        """Make the frame's byte ranges ``[start, end)`` local: the parts not pulled yet,
        as one engine transfer."""
        want = merge_spans([(max(a, 0), min(b, self.size)) for a, b in ranges])
        missing = [g for a, b in want for g in self._have.missing(a, b)]
        if not missing:
            return
        reads = [(self._base + a, self._src + a, b - a) for a, b in missing]
        self._reads = [f for f in self._reads if not f.done()]
        self._puller.read_many(
            self._session,
            reads,
            deadline,
            cancel=cancel,
            what=self._what,
            keep=self._view,
            track=self._reads,
        )
        self.moved += sum(n for _l, _r, n in reads)
        for a, b in missing:
            self._have.add(a, b)

    def _wait(
        self, start: int, need: int, end: int, deadline: float, cancel: threading.Event | None
    ) -> int:
        self._pull_ranges([(start, end)], deadline, cancel)
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
    ``inline``: a small raw buffer's bytes from the acquire reply (:func:`inline_of`), for
    a host-pool ``local``: nothing is read then.

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
        inline: bytes | None = None,
    ) -> None:
        self._puller, self._session, self._src, self._lease = puller, session, src_addr, lease
        self._local, self._what, self._frame = local, what, frame
        self._inline = inline
        self.size = size
        self.obj = None if frame else local
        self._loaded = self._started = False
        self._reads: list[cf.Future[None]] = []  # the engine read into ``local``, once asked

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
            if self._inline is not None:
                ctypes.memmove(self._local.address, self._inline, self.size)
            elif self.size:
                self._puller.read(
                    self._session,
                    self._local.address,
                    self._src,
                    self.size,
                    deadline,
                    cancel,
                    what=self._what,
                    track=self._reads,
                )
            self.moved = self.size
        except BaseException:
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
        if not self._loaded:  # never handed out: free it once no engine read runs into it
            self._loaded = True  # (once: a second close must not free it under a read)
            when_reads_end(self._reads, self._local.release)
        self.obj = None
