"""Writing a move's pages into a device cache, at a cost that does not grow with pages.

:class:`PageScatter` takes the page copies of one move (payload pages, where each goes, the
cache layer) between identities with the same bytes. Entering it uploads every copy's block
ids at once (one non-blocking copy from pinned memory, :mod:`.device_scratch`); each
:meth:`PageScatter.write` then brings the given layers' host bytes to the device in one copy
per contiguous frame region of up to 64 MiB (a reusable device buffer) and writes each layer with one
``index_copy_``. :meth:`PageScatter.finish` is the one host wait: the frame may be released
only after the copies out of it ran. Pages already on the device are scattered directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import bits
from vllm_omni_kv.kvcache.device_order import Streams, streams_of
from vllm_omni_kv.kvcache.device_scratch import KEEP_BYTES, MoveScratch, thread_scratch
from vllm_omni_kv.wire.stream import PayloadStream, Span

#: host regions of a batch closer than this travel in one copy (the gap with them)
MERGE_GAP = 1 << 20


@dataclass
class PageCopy:
    """Pages ``src`` (``[n, *page]``) written into blocks ``ids`` of ``pages`` (a page view)."""

    src: torch.Tensor
    pages: torch.Tensor
    ids: Sequence[int]


def _host_region(start: int, nbytes: int) -> torch.Tensor:
    raw = (ctypes.c_char * nbytes).from_address(start)
    return torch.frombuffer(raw, dtype=torch.uint8)


def _end(t: torch.Tensor, frame_address: int | None) -> int:
    """The frame offset the bytes of ``t`` end at (0 without one frame: all at once)."""
    if frame_address is None:
        return 0
    return t.data_ptr() - frame_address + t.numel() * t.element_size()


def _streams(copies: Sequence[PageCopy]) -> Streams:
    streams = streams_of(copies[0].pages.device)
    assert streams is not None, "page_scatter is the device path"
    return streams


def _regions(copies: Sequence[PageCopy]) -> list[tuple[int, int, list[PageCopy]]]:
    """Host copies grouped into ``(start, end, copies)`` address ranges, each one upload of
    at most ``KEEP_BYTES`` (unless one copy alone is larger)."""
    out: list[tuple[int, int, list[PageCopy]]] = []
    for c in sorted(copies, key=lambda c: c.src.data_ptr()):
        lo = c.src.data_ptr()
        hi = lo + c.src.numel() * c.src.element_size()
        if out and out[-1][1] <= lo <= out[-1][1] + MERGE_GAP and hi - out[-1][0] <= KEEP_BYTES:
            out[-1] = (out[-1][0], max(out[-1][1], hi), [*out[-1][2], c])
        else:
            out.append((lo, hi, [c]))
    return out


class PageScatter:
    """The page copies of one move into a device cache (see the module doc)."""

    def __init__(self, copies: Sequence[PageCopy], device: torch.device, streams: Streams) -> None:
        self.copies = list(copies)
        self.device = device
        self.streams = streams
        self._scratch: MoveScratch = thread_scratch(device, streams)
        self._idx: dict[int, torch.Tensor] = {}  # id(copy) -> its ids on the device
        self._move: contextlib.ExitStack | None = None

    def __enter__(self) -> PageScatter:
        move = contextlib.ExitStack()
        scratch = move.enter_context(self._scratch.use())
        flat = [int(b) for c in self.copies for b in c.ids]
        if flat:
            idx = scratch.ids(flat)
            at = 0
            for c in self.copies:
                self._idx[id(c)] = idx[at : at + len(c.ids)]
                at += len(c.ids)
        self._move = move
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:  # nothing may still read the frame when the caller drops it
            self.finish()
        if self._move is not None:
            self._move.close()
            self._move = None

    def write(self, copies: Sequence[PageCopy]) -> None:
        """Write ``copies`` (some of this move's; their bytes are final)."""
        host = [c for c in copies if c.src.device.type == "cpu" and c.src.is_contiguous()]
        for c in copies:
            if not any(c is h for h in host):
                self._scatter(c, c.src.to(self.device, non_blocking=True))
        for lo, hi, group in _regions(host):
            dev = self._scratch.bytes(hi - lo)
            dev.copy_(_host_region(lo, hi - lo), non_blocking=True)
            for c in group:
                at = c.src.data_ptr() - lo
                n = c.src.numel() * c.src.element_size()
                self._scatter(c, dev[at : at + n].view(c.src.dtype).view(c.src.shape))

    def _scatter(self, c: PageCopy, src: torch.Tensor) -> None:
        if c.src.shape[0]:
            pages = src.reshape(src.shape[0], *c.pages.shape[1:])
            bits(c.pages).index_copy_(0, self._idx[id(c)], bits(pages))

    def finish(self) -> None:
        """Wait on the host until every write of this move ran (the source frame may be
        released after this)."""
        self.streams.current(self.device).synchronize()


def scatter_all(copies: Sequence[PageCopy], device: torch.device, streams: Streams) -> None:
    """Write ``copies`` (complete) into their device cache and wait for them."""
    with PageScatter(copies, device, streams) as scatter:
        scatter.write(copies)
        scatter.finish()


def apply_scatter(
    stream: PayloadStream,
    spans: list[Span] | None,
    copies: Sequence[PageCopy],
    deadline: float,
    cancel: threading.Event | None = None,
) -> None:
    """Write ``copies`` (views of ``stream``'s frame) as their bytes become final: the
    layers final together cross in one copy; one host wait at the end (the frame is
    released when the caller closes the stream)."""
    base = stream.frame_address
    order = sorted((_end(c.src, base), i) for i, c in enumerate(copies))
    with PageScatter(copies, copies[0].pages.device, _streams(copies)) as scatter:
        for ready in stream.load(spans, deadline, cancel):
            batch = []
            while order and order[0][0] <= ready:
                batch.append(copies[order.pop(0)[1]])
            scatter.write(batch)
        if order:
            raise KVPayloadError(f"the stream ended with {len(order)} layers not written")
        scatter.finish()
