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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.closing import Closing
from vllm_omni_kv.errors import KVTransferCancelled, KVTransferError
from vllm_omni_kv.wire.digests import Run, Span, verify_chunk
from vllm_omni_kv.wire.prelude import PACK_STEP
from vllm_omni_kv.wire.unpack import FrameInfo, materialize, parse

#: ``load`` value meaning "every requested byte": compares above any frame offset
ALL_READY = 1 << 62

__all__ = [
    "ALL_READY",
    "ArrivedFrameStream",
    "ChunkedStream",
    "CompleteStream",
    "PayloadStream",
    "Span",
    "tensor_span",
]


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

    def ready(self, deadline: float, cancel: threading.Event | None = None) -> Iterator[int]:
        """``load`` of every byte of the frame."""
        return self.load(None, deadline, cancel)

    def close(self) -> None:
        """Release the backend's hold on the frame (views of ``obj`` keep its memory)."""
        self.obj = None


class CompleteStream(PayloadStream):
    """A stream over an object that was received and verified in full."""

    def __init__(self, obj: Any, size: int) -> None:
        self.obj = obj
        self.size = size
        self.moved = size

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        check_cancel(cancel, "the load")
        yield ALL_READY


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

    def load(
        self,
        spans: Sequence[Span] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        if self._mv is None:
            raise KVTransferError("the stream is closed")
        if self._started:
            raise KVTransferError("a stream's load() / ready() can be iterated only once")
        self._started = True
        check_cancel(cancel, "the load")
        if spans is not None:
            for a, b in spans:
                if not 0 <= a <= b <= self.size:
                    raise KVTransferError(
                        f"load span [{a}, {b}) is outside the {self.size}-byte frame"
                    )
        yield from self._bring(self._info.chunks.runs(spans), deadline, cancel)
        self._finish(deadline, cancel)
        yield self.size

    def _bring(
        self, runs: Sequence[Run], deadline: float, cancel: threading.Event | None
    ) -> Iterator[int]:
        mv, cm = self._mv, self._info.chunks
        assert mv is not None
        trailer, verify, count = cm.trailer_start, self._verify, self.count_chunks
        for run in runs:
            rs, re = cm.extent(run)
            avail = last = rs
            for k, s, e in cm.iter_bounds(*run):
                if e > avail:
                    avail = self._wait(avail, e, re, deadline, cancel)
                if verify:
                    verify_chunk(mv, trailer, k, s, e)
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
