"""Payload streams: a received frame whose bytes may still be arriving.

A backend that can hand a frame over while its producer is still writing it
(``supports_streaming``) returns a stream from ``open_stream``: its ``obj`` is
the decoded object (tensors are views whose bytes fill in as the producer
goes), and ``ready(deadline)`` yields how many leading bytes of the frame are
final and already checksummed. A reader copies each step out while it is
still in cache, so the two copies of a transfer overlap. The checksum of the
whole frame is compared after the last step: until ``ready`` has returned,
bytes copied out are unverified, and a failure means they must not be used.

Backends without streaming wrap a finished ``get`` in :class:`CompleteStream`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm_omni_kv.closing import Closing

#: ``ready`` value meaning "every byte": compares above any frame offset
ALL_READY = 1 << 62


class PayloadStream(Closing):
    """One received frame; use as a context manager (``close`` releases its buffer)."""

    obj: Any = None
    size: int = 0
    #: address of the frame's byte 0 in this process, or None when tensors are not
    #: views of one frame (then ``ready`` yields only ``ALL_READY``)
    frame_address: int | None = None

    def ready(self, deadline: float) -> Iterator[int]:
        """Yield the count of leading frame bytes that are final, until all are verified.

        Raises ``KVTransferTimeout`` at ``deadline`` (``time.monotonic``),
        ``KVPayloadError`` on a checksum mismatch and ``KVTransferError`` when
        the producer failed or exited mid-write.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release the frame; ``obj``'s tensors must not be used afterwards."""
        self.obj = None


class CompleteStream(PayloadStream):
    """A stream over an object that was received and verified in full."""

    def __init__(self, obj: Any, size: int) -> None:
        self.obj = obj
        self.size = size

    def ready(self, deadline: float) -> Iterator[int]:
        yield ALL_READY
