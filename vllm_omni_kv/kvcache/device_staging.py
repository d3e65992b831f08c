"""Producer-side staging of a request's pages on the cache's device.

A payload read straight out of a GPU cache would cost one ``index_select``
temporary per layer and one synchronous device-to-host copy per layer, on
whatever stream the packing thread happens to use. :class:`DeviceStager`
instead gathers the pages of every layer into one reusable device buffer, on a
side stream that first waits for an event recorded after the forward pass; the
forward stream then waits for the gather to finish, so blocks vLLM frees and
reuses next step are never overwritten before they were read.

Packing copies each layer's slice of that buffer into the frame on the same side
stream. Into host memory the copy is waited for before the layer is reported
packed (the frame's bytes are final when a reader sees them). Into device memory (a
frame packed in a device pool) no host wait: the side stream first waits for the
work queued on the packing thread's stream (the frame's zero fill and header), and
that stream then waits for the copy, so whatever it does with the frame next (the
copy into the pool block) sees every layer.

Stream operations come from :mod:`.device_order`; on a host device the same code runs
synchronously (no streams), which is how CI exercises the slicing on vLLM's GPU
layouts without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.cache_layout import bits
from vllm_omni_kv.kvcache.device_order import DeviceEvent, Streams, mark, streams_of

#: default bound on the device memory all staging buffers of one stager may hold
DEFAULT_STAGING_BYTES = 256 << 20
#: staging buffers are sized in multiples of this, so similar requests reuse one
GRANULE = 2 << 20


def _rounded(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` as its tensors report it: an accelerator without an index is the
    current one (``"cuda"`` -> ``cuda:<current>``), and the host has no index."""
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    current = getattr(getattr(torch, d.type, None), "current_device", None)
    if d.index is None and callable(current):
        return torch.device(d.type, int(current()))
    return d


@dataclass(frozen=True)
class _Slice:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class StagedPages:
    """One request's pages of every layer, gathered into one staging buffer.

    ``fill(i)`` is the frame-filling callback of layer ``i``; the buffer returns to its
    stager once every layer was copied out or :meth:`close` is called.
    """

    def __init__(
        self,
        stager: DeviceStager,
        buf: torch.Tensor,
        slices: list[_Slice | None],
        gathered: DeviceEvent | None,
    ) -> None:
        self._stager = stager
        self._buf: torch.Tensor | None = buf
        self._slices = slices
        self._gathered = gathered
        self._pending = {i for i, s in enumerate(slices) if s is not None}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, stager._give_back, buf)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slices if s is not None)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s gathered pages (a view into the staging buffer)."""
        s = self._slices[i]
        if s is None or self._buf is None:
            raise ConfigError(f"layer {i} has no staged pages (skipped layer or closed)")
        n = s.nbytes
        return self._buf[s.offset : s.offset + n].view(s.dtype).view(s.shape)

    def fill(self, i: int) -> Callable[[torch.Tensor], Iterator[int]]:
        """The callback that copies layer ``i`` into ``dst`` (host or device memory)."""

        def run(dst: torch.Tensor) -> Iterator[int]:
            src = self.layer(i)
            streams = self._stager.streams
            if streams is None:
                bits(dst).copy_(bits(src))
            else:
                self._copy_out(streams, src, dst)
            self._done(i)
            yield dst.numel() * dst.element_size()

        return run

    def _copy_out(self, streams: Streams, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` on the stager's side stream (after the gather, which
        was queued there): into device memory ordered both ways with the packing
        thread's stream, into host memory waited for."""
        stream = self._stager.side
        assert stream is not None
        on_device = dst.device.type != "cpu" or dst.device == self._stager.device
        packer = streams.current(dst.device) if on_device else None
        with streams.use(stream):
            if packer is not None:  # after the frame's zero fill and header
                stream.wait_stream(packer)
            bits(dst).copy_(bits(src), non_blocking=dst.is_pinned() or on_device)
            done = streams.event()
            done.record(stream)
        if packer is not None:
            packer.wait_event(done)  # the frame's next use sees this layer
        else:
            done.synchronize()  # the bytes are final when this layer is reported packed

    def _done(self, i: int) -> None:
        with self._lock:
            self._pending.discard(i)
            last = not self._pending
        if last:
            self.close()

    def close(self) -> None:
        """Give the staging buffer back (idempotent). Every use of a staging buffer is
        queued on the stager's one side stream, so a later gather into it runs after
        copies still queued from it."""
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is None:
            return
        self._finalizer.detach()
        self._stager._give_back(buf)


class DeviceStager:
    """Reusable device staging buffers and the side stream of one cache device.

    ``max_bytes`` bounds the device memory held by all buffers; :meth:`gather` returns
    None when a request does not fit (the caller then reads the cache directly).
    """

    def __init__(self, device: torch.device | str, max_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = canonical_device(device)
        if max_bytes <= 0:
            raise ConfigError(f"staging_bytes must be > 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        #: the device's stream operations (None on the host: everything synchronous)
        self.streams: Streams | None = streams_of(self.device)
        #: the side stream every gather and copy out of a staging buffer runs on
        self.side = None if self.streams is None else self.streams.new_stream(self.device)
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._held = 0  # bytes of all buffers, free or in use
        self.gathers = 0
        self.fallbacks = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def _take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free.remove(best)
                return best
            want = _rounded(nbytes)
            # drop smaller idle buffers to make room for a bigger one
            while self._free and self._held + want > self.max_bytes:
                self._held -= self._free.pop(0).numel()
            if self._held + want > self.max_bytes:
                return None
            self._held += want
        return torch.empty(want, dtype=torch.uint8, device=self.device)

    def _give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def gather(
        self, page_views: Sequence[torch.Tensor | None], ids: Sequence[int]
    ) -> StagedPages | None:
        """Stage pages ``ids`` of every layer's page view (``[blocks, *page]``), ordered
        after the work already queued on the current stream. None when it does not fit."""
        slices: list[_Slice | None] = []
        off = 0
        for pv in page_views:
            if pv is None:
                slices.append(None)
                continue
            if pv.device != self.device:
                raise ConfigError(f"a page view on {pv.device} given to the {self.device} stager")
            s = _Slice(off, (len(ids), *pv.shape[1:]), pv.dtype)
            slices.append(s)
            off += -(-s.nbytes // 256) * 256  # aligned starts for every layer
        buf = self._take(max(off, 1))
        if buf is None:
            self.fallbacks += 1
            return None
        staged = StagedPages(self, buf, slices, None)
        idx = torch.tensor(list(ids), dtype=torch.long)
        if self.streams is None or self.side is None:
            self._gather_into(staged, page_views, idx)
        else:
            after_forward = mark(self.streams, self.device)
            forward = self.streams.current(self.device)
            with self.streams.use(self.side):
                self.side.wait_event(after_forward)
                self._gather_into(staged, page_views, idx.to(self.device, non_blocking=True))
                gathered = self.streams.event()
                gathered.record(self.side)
            forward.wait_event(gathered)  # blocks freed after this step are read first
            staged._gathered = gathered
        self.gathers += 1
        return staged

    @staticmethod
    def _gather_into(
        staged: StagedPages, page_views: Sequence[torch.Tensor | None], idx: torch.Tensor
    ) -> None:
        for i, pv in enumerate(page_views):
            if pv is not None:
                torch.index_select(bits(pv), 0, idx, out=bits(staged.layer(i)))

    def close(self) -> None:
        """Drop the idle buffers (buffers in use return and stay until the next close)."""
        with self._lock:
            for b in self._free:
                self._held -= b.numel()
            self._free.clear()
