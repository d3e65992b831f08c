"""Payload streams: the one way a backend hands a received frame to its reader.

``OmniConnectorBase.open_stream`` returns a :class:`PayloadStream` as soon as the
frame's header is known. Its ``obj`` is the decoded object: tensors are views into
the frame's local bytes, and those bytes are valid only inside ranges that
``load`` has made final. ``load(spans, deadline)`` brings just the requested byte
ranges of the frame across the transport (``None``: every byte), verifies them
and yields increasing frame offsets ``o``: every requested byte below ``o`` is
final and verified. A reader copies each step out while it is still in cache,
and one that needs only part of a payload (the blocks it lacks) moves only that
part. ``moved`` counts the bytes this stream brought across the transport.

Close the stream (it is a context manager) when done: that releases the backend's
hold on the frame. Tensor views taken from ``obj`` pin the frame's memory until
they are garbage collected, so a caller that keeps ``obj`` keeps valid views.

A reader computes the span of a tensor view ``t`` of ``obj`` (or of a block range
``t[first:last]`` of a contiguous one) with :func:`tensor_span`. Frames carry one
digest per chunk, so backends built on :class:`ChunkedStream` move and verify
only the chunks that cover the requested spans (plus header and digest trailer).
Streams over objects that are not frames (a raw buffer) are :class:`CompleteStream`.

A reader with an auth key (:mod:`.auth`) calls ``authenticate(key)`` right after
opening (a reader without one calls ``authenticate(None)``): a keyed frame
without a key here, an unkeyed frame with one, or a stream that cannot be
authenticated raise :class:`KVPayloadError`; afterwards every chunk ``load``
reaches is checked against its keyed tag and the head MAC before the final
value is yielded (``copy_into`` returns).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.closing import Closing
from vllm_omni_kv.errors import KVPayloadError, KVTransferCancelled, KVTransferError
from vllm_omni_kv.wire.auth import AuthKey, check_keying, verify_chunk_tag, verify_head_mac
from vllm_omni_kv.wire.digests import Run, Span, verify_chunk
from vllm_omni_kv.wire.prelude import PACK_STEP, read_prelude
from vllm_omni_kv.wire.unpack import FrameInfo, authenticate_frame, materialize, parse

#: ``load`` value meaning "every requested byte": compares above any frame offset
ALL_READY = 1 << 62

__all__ = [
    "ALL_READY",
    "ArrivedFrameStream",
    "ChunkedStream",
    "CompleteStream",
    "CopyOut",
    "PayloadStream",
    "Span",
    "tensor_span",
]


#: one copy out of a frame: frame bytes ``[start, end)`` go to host address ``dst``;
#: ``view`` is a writable byte view of exactly those ``end - start`` destination bytes
CopyOut = tuple[int, int, int, memoryview]


def check_cancel(cancel: threading.Event | None, what: str) -> None:
    """Raise ``KVTransferCancelled`` when ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise KVTransferCancelled(f"{what} was cancelled")


class PayloadStream(Closing):
    """One received frame; use as a context manager."""

    obj: Any = None
    size: int = 0
    #: address of the frame's byte 0 in this process, or None when tensors are not
    #: views of one frame (then ``load`` yields only ``ALL_READY``)
    frame_address: int | None = None
    #: bytes this stream has brought across the transport so far
    moved: int = 0

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Make the frame bytes in ``spans`` (sorted, disjoint; None: all) final and verified.

        Yields increasing offsets; every requested byte below the last value yielded
        is final and verified. Raises ``KVTransferTimeout`` at ``deadline``
        (``time.monotonic``), ``KVTransferCancelled`` once ``cancel`` is set (checked
        at least every millisecond while waiting), ``KVPayloadError`` when bytes fail
        verification and ``KVTransferError`` when the producer failed or exited.
        May be iterated once per stream.
        """
        raise NotImplementedError

    def authenticate(self, auth: AuthKey | None) -> None:
        """Apply the reader's key policy (call once, before ``load``; see the module doc).

        This base class knows no frame to check: it accepts only ``None``.
        """
        if auth is not None:
            raise KVPayloadError(
                f"payload not authenticated: {type(self).__name__} hands over a payload whose "
                "frame bytes cannot be checked against the auth key (e.g. a device-pool "
                "frame); use a host pool or leave auth_key_file unset on both stages"
            )

    def ready(self, deadline: float, cancel: threading.Event | None = None) -> Iterator[int]:
        """``load`` of every byte of the frame."""
        return self.load(None, deadline, cancel)

    def copy_into(
        self, copies: Sequence[CopyOut], deadline: float, cancel: threading.Event | None = None
    ) -> None:
        """Copy frame ranges (sorted by start, disjoint) to host memory, every byte verified.

        Replaces ``load`` (a stream is read once). Needs ``frame_address``. The
        default loads each range, then copies it; chunked streams copy first and
        verify the copy while it is in cache. On an error, destinations may hold
        part of the frame: do not use them.
        """
        base = self.frame_address
        if base is None:
            raise KVTransferError("this stream's tensors are not views of one frame: use load()")
        i = 0
        for ready in self.load(_copy_spans(copies), deadline, cancel):
            while i < len(copies) and copies[i][1] <= ready:
                start, end, dst, _view = copies[i]
                ctypes.memmove(dst, base + start, end - start)
                i += 1

    def close(self) -> None:
        """Release the backend's hold on the frame (views of ``obj`` keep its memory)."""
        self.obj = None


class CompleteStream(PayloadStream):
    """A stream over an object that was received and verified in full.

    ``frame``: the frame bytes ``obj`` was decoded from, when the stream can be
    authenticated (see ``authenticate``).
    """

    def __init__(self, obj: Any, size: int, frame: Any = None) -> None:
        self.obj = obj
        self.size = size
        self.moved = size
        self._frame = frame

    def authenticate(self, auth: AuthKey | None) -> None:
        if self._frame is None:
            super().authenticate(auth)
            return
        if auth is None:  # ``obj`` was decoded from the frame: its prelude says it all
            mv = memoryview(self._frame).cast("B")
            check_keying(read_prelude(mv, mv.nbytes).keyed, None)
        else:
            authenticate_frame(self._frame, auth)

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        check_cancel(cancel, "the load")
        yield ALL_READY


def _copy_spans(copies: Sequence[CopyOut]) -> list[Span]:
    spans: list[Span] = []
    last = -1
    for start, end, _dst, view in copies:
        if start < last or end < start or view.nbytes != end - start:
            raise KVTransferError(
                "copy_into needs sorted, disjoint copies whose views match their ranges"
            )
        last = end
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def merge_spans(spans: Sequence[Span]) -> list[Span]:
    """Sorted spans with touching or overlapping ones merged."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def tensor_span(stream: PayloadStream, t: torch.Tensor) -> Span:
    """The frame bytes of ``t``, a contiguous view into ``stream.obj`` (e.g. ``k[first:last]``
    for a block range of a contiguous tensor ``k``), as a span for ``load``."""
    if stream.frame_address is None:
        raise KVTransferError("this stream's tensors are not views of one frame: load(None)")
    if not t.is_contiguous():
        raise KVTransferError("tensor_span needs a contiguous view (slice along dim 0)")
    start = t.data_ptr() - stream.frame_address
    end = start + t.numel() * t.element_size()
    if not 0 <= start <= end <= stream.size:
        raise KVTransferError(f"tensor bytes [{start}, {end}) lie outside this stream's frame")
    return start, end


class ChunkedStream(PayloadStream):
    """A frame whose data a backend brings in chunk-aligned ranges, each chunk verified
    against its digest before it is handed out.

    A subclass makes prelude and header local, then calls :meth:`_start`; it
    overrides :meth:`_wait` when bytes arrive after that and :meth:`_finish` to check
    the header and trailer at the end (when they were not checked before).
    """

    #: count the bytes of chunks handed out in ``moved`` (readers of shared memory)
    count_chunks = False
    _mv: memoryview | None = None
    _info: FrameInfo
    _verify = False
    _started = False
    #: the reader's key once ``authenticate`` accepted it (None: unkeyed frame, no key)
    _mac: AuthKey | None = None
    _authenticated = False

    def _start(
        self,
        mv: memoryview,
        info: FrameInfo,
        *,
        verify: bool,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> None:
        """Bring and verify the blob chunks (decoding copies blobs), then build ``obj``."""
        self._mv, self._info = mv, info
        self._verify = verify and info.has_digests
        self.size = info.total
        for _ in self._bring(info.blob_runs(), deadline, cancel):
            pass
        self.obj = materialize(mv, info)

    def _wait(
        self, start: int, need: int, end: int, deadline: float, cancel: threading.Event | None
    ) -> int:
        """Make frame bytes ``[start, need)`` final; return how far (<= ``end``) they are."""
        return end

    def _finish(self, deadline: float, cancel: threading.Event | None) -> None:
        """Runs after the last requested chunk, before the final value is yielded."""

    def _failed(self) -> None:
        """Runs when ``load`` or ``copy_into`` raises (before the error propagates)."""

    def authenticate(self, auth: AuthKey | None) -> None:
        """Check the key policy now and the blob chunks' tags (decoding brought them);
        ``load`` checks the tags of the chunks it reaches and, at its end, the head MAC."""
        if self._mv is None:
            raise KVTransferError("the stream is closed")
        p = self._info.prelude
        check_keying(p.keyed, auth)
        self._mac, self._authenticated = auth, True
        if auth is not None:
            for first, last in self._info.blob_runs():
                for k, s, e in self._info.chunks.iter_bounds(first, last):
                    verify_chunk_tag(self._mv, p.tags_start, k, s, e, auth)

    def _check_head_mac(self) -> None:
        if self._mac is not None and self._mv is not None:
            verify_head_mac(self._mv, self._info.prelude, self._mac)

    def _begin(self, spans: Sequence[Span] | None, cancel: threading.Event | None) -> None:
        if self._mv is None:
            raise KVTransferError("the stream is closed")
        if self._started:
            raise KVTransferError("a stream can be read (load / copy_into) only once")
        self._started = True
        if self._info.prelude.keyed and not self._authenticated:
            check_keying(True, None)
        check_cancel(cancel, "the load")
        for a, b in spans or ():
            if not 0 <= a <= b <= self.size:
                raise KVTransferError(f"load span [{a}, {b}) is outside the {self.size}-byte frame")

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        self._begin(spans, cancel)
        try:
            yield from self._bring(self._info.chunks.runs(spans), deadline, cancel)
            self._finish(deadline, cancel)
            self._check_head_mac()
        except GeneratorExit:
            raise
        except BaseException:
            self._failed()
            raise
        yield self.size

    def copy_into(
        self, copies: Sequence[CopyOut], deadline: float, cancel: threading.Event | None = None
    ) -> None:
        spans = _copy_spans(copies)
        self._begin(spans, cancel)
        try:
            self._copy_out(copies, spans, deadline, cancel)
            self._finish(deadline, cancel)
            self._check_head_mac()
        except BaseException:
            self._failed()
            raise

    def _copy_out(
        self,
        copies: Sequence[CopyOut],
        spans: Sequence[Span],
        deadline: float,
        cancel: threading.Event | None,
    ) -> None:
        """Copy each range once its chunks are final; a chunk that lies inside one copy is
        verified in its destination right after the copy (the bytes are in cache, and
        what is checked is what was written), any other chunk in the frame before."""
        mv, cm, base = self._mv, self._info.chunks, self.frame_address
        assert mv is not None and base is not None
        trailer, verify, count = cm.trailer_start, self._verify, self.count_chunks
        mac, tags, alg = self._mac, self._info.prelude.tags_start, self._info.prelude.alg
        runs = cm.runs(spans)
        extents = [cm.extent(r) for r in runs]
        chunks = [c for r in runs for c in cm.iter_bounds(*r)]
        ri, ci, done_k, avail = 0, 0, -1, 0
        for start, end, dst, view in copies:
            if end <= start:
                continue
            while ci < len(chunks) and chunks[ci][2] <= start:
                ci += 1
            if ci == len(chunks) or chunks[ci][1] > start:
                raise KVTransferError(f"copy of frame bytes [{start}, {end}) is not tensor data")
            last = ci
            while last + 1 < len(chunks) and chunks[last + 1][1] < end:
                last += 1
            need = chunks[last][2]
            if need < end:
                raise KVTransferError(f"copy of frame bytes [{start}, {end}) is not tensor data")
            if need > avail:
                while extents[ri][1] <= start:
                    ri += 1
                avail = self._wait(
                    max(avail, extents[ri][0]), need, extents[ri][1], deadline, cancel
                )
            if verify or mac is not None:
                for k, s, e in chunks[ci : last + 1]:
                    if k > done_k and (s < start or e > end):
                        if verify:
                            verify_chunk(mv, trailer, k, s, e, alg=alg)
                        if mac is not None:
                            verify_chunk_tag(mv, tags, k, s, e, mac)
            ctypes.memmove(dst, base + start, end - start)
            for k, s, e in chunks[ci : last + 1]:
                if k <= done_k:
                    continue
                if start <= s and e <= end:
                    if verify:
                        verify_chunk(mv, trailer, k, s, e, view[s - start : e - start], alg)
                    if mac is not None:
                        verify_chunk_tag(mv, tags, k, s, e, mac, view[s - start : e - start])
                if count:
                    self.moved += e - s
            done_k = max(done_k, chunks[last][0])
            check_cancel(cancel, "the load")

    def _bring(
        self, runs: Sequence[Run], deadline: float, cancel: threading.Event | None
    ) -> Iterator[int]:
        mv, cm = self._mv, self._info.chunks
        assert mv is not None
        trailer, verify, count = cm.trailer_start, self._verify, self.count_chunks
        mac, tags, alg = self._mac, self._info.prelude.tags_start, self._info.prelude.alg
        for run in runs:
            rs, re = cm.extent(run)
            avail = last = rs
            for k, s, e in cm.iter_bounds(*run):
                if e > avail:
                    avail = self._wait(avail, e, re, deadline, cancel)
                if verify:
                    verify_chunk(mv, trailer, k, s, e, alg=alg)
                if mac is not None:
                    verify_chunk_tag(mv, tags, k, s, e, mac)
                if count:
                    self.moved += e - s
                if e >= avail or e - last >= PACK_STEP:
                    check_cancel(cancel, "the load")
                    last = e
                    yield e

    def close(self) -> None:
        self.obj = None
        self._mv = None


class ArrivedFrameStream(ChunkedStream):
    """A frame that arrived whole in ``buf`` (``moved`` is its size): header and trailer
    are verified at once, each requested chunk when ``load`` reaches it."""

    def __init__(self, buf: Any, *, verify: bool = True) -> None:
        mv = memoryview(buf).cast("B")
        self.frame_address = (
            int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if mv.nbytes else None
        )
        self.moved = mv.nbytes
        info = parse(mv, mv.nbytes, verify_head=verify)
        self._start(mv, info, verify=verify, deadline=float("inf"))
