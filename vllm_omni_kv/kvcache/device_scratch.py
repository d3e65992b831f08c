"""Reusable device buffers of one move: its block ids, uploaded once, and its bytes.

A move between a device cache and anything else (staging a request's pages, injecting a
payload) uploads its block ids with one non-blocking copy from a pinned host buffer and,
where its data crosses the bus in one piece, passes it through one device byte buffer.
Both buffers are kept and grown geometrically, so the steady path allocates nothing.

Reuse is ordered by events, never by the caller's care: the host rewrites the kept pinned
ids only once their previous upload ran (and, while it has not, uploads through a pinned
buffer of its own: no host wait), and each move's stream first waits on the device for the
previous move's last use (:meth:`MoveScratch.use`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from vllm_omni_kv.kvcache.device_order import DeviceEvent, Streams

#: the largest byte buffer kept between moves (device memory outside vLLM's budget, per
#: thread): bigger uploads are split (:mod:`.page_scatter`) or take a temporary
KEEP_BYTES = 64 << 20
_MIN_IDS = 1024


def _grown(have: int, need: int) -> int:
    """The next capacity: at least ``need``, at least twice ``have``."""
    return max(need, 2 * have)


class MoveScratch:
    """The ids and byte buffers of moves on one device, one move at a time."""

    def __init__(self, device: torch.device, streams: Streams) -> None:
        self.device = device
        self.streams = streams
        self._lock = threading.Lock()
        self._host_ids: torch.Tensor | None = None
        self._dev_ids: torch.Tensor | None = None
        self._bytes: torch.Tensor | None = None
        self._uploaded: DeviceEvent | None = None  # after the last ids upload
        self._done: DeviceEvent | None = None  # after the last move's last use

    @contextlib.contextmanager
    def use(self) -> Iterator[MoveScratch]:
        """One move on the calling thread's current stream: it first waits (on the device)
        for the previous move's use of these buffers; an event after its own closes it."""
        with self._lock:
            stream = self.streams.current(self.device)
            if self._done is not None:
                stream.wait_event(self._done)
            try:
                yield self
            finally:
                done = self.streams.event()
                done.record(self.streams.current(self.device))
                self._done = done

    def ids(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``ids`` as a ``long`` tensor on the device: one non-blocking copy from pinned
        memory, queued on the current stream (call inside :meth:`use`). Never a host wait:
        while the kept pinned buffer's last upload has not run (it may be queued behind a
        forward), this one goes through a pinned buffer of its own, which torch's pinned
        allocator keeps until the copy ran."""
        n = len(ids)
        pin = self.device.type == "cuda"
        if self._host_ids is None or self._host_ids.numel() < n:
            cap = _grown(0 if self._host_ids is None else self._host_ids.numel(), max(n, _MIN_IDS))
            self._host_ids = torch.empty(cap, dtype=torch.long, pin_memory=pin)
            self._dev_ids = torch.empty(cap, dtype=torch.long, device=self.device)
            host = self._host_ids
        elif self._uploaded is not None and not self._uploaded.query():
            host = torch.empty(n, dtype=torch.long, pin_memory=pin)
        else:
            host = self._host_ids
        assert self._dev_ids is not None
        if isinstance(ids, torch.Tensor):
            host[:n].copy_(ids)
        else:
            host.numpy()[:n] = ids
        out = self._dev_ids[:n]
        out.copy_(host[:n], non_blocking=True)
        if host is self._host_ids:  # only the kept buffer's reuse waits for this upload
            self._uploaded = self.streams.event()
            self._uploaded.record(self.streams.current(self.device))
        return out

    def bytes(self, n: int) -> torch.Tensor:
        """A ``uint8`` device buffer of ``n`` bytes (kept up to :data:`KEEP_BYTES`)."""
        if n > KEEP_BYTES:
            return torch.empty(n, dtype=torch.uint8, device=self.device)
        if self._bytes is None or self._bytes.numel() < n:
            have = 0 if self._bytes is None else self._bytes.numel()
            self._bytes = None  # freed before the bigger one is allocated
            self._bytes = torch.empty(
                min(KEEP_BYTES, _grown(have, n)), dtype=torch.uint8, device=self.device
            )
        return self._bytes[:n]


_local = threading.local()


def thread_scratch(device: torch.device, streams: Streams) -> MoveScratch:
    """The calling thread's :class:`MoveScratch` for ``device`` (each load thread has its
    own stream, so each has its own buffers)."""
    by_device: dict[torch.device, MoveScratch] | None = getattr(_local, "s", None)
    if by_device is None:
        by_device = _local.s = {}
    scratch = by_device.get(device)
    if scratch is None or scratch.streams is not streams:
        scratch = by_device[device] = MoveScratch(device, streams)
    return scratch
