"""Producer-side staging of a request's pages on the cache's device.

A payload read straight out of a GPU cache would cost one ``index_select``
temporary per layer and one synchronous device-to-host copy per layer, on
whatever stream the packing thread happens to use. :class:`DeviceStager`
instead gathers the pages of every layer into one reusable device buffer, on a
side stream that first waits for an event recorded after the forward pass; the
forward stream then waits for the gather to finish, so blocks vLLM frees and
reuses next step are never overwritten before they were read. Packing copies each
layer's slice of that buffer into the frame on the same side stream and returns
once the copy has landed: the frame is published only after its bytes are final.

On a host device the same code runs synchronously (no streams), which is how CI
exercises the slicing on vLLM's GPU layouts without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.cache_layout import bits

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
        gathered: torch.cuda.Event | None,
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
            stream = self._stager.stream
            if stream is None:
                bits(dst).copy_(bits(src))
            else:
                with torch.cuda.stream(stream):
                    # after the gather, on the stream that did it; async into pinned memory
                    bits(dst).copy_(bits(src), non_blocking=dst.is_pinned() or dst.is_cuda)
                    done = torch.cuda.Event()
                    done.record(stream)
                done.synchronize()
            self._done(i)
            yield dst.numel() * dst.element_size()

        return run

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
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        )
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
        if self.stream is None:
            self._gather_into(staged, page_views, idx)
        else:
            forward = torch.cuda.current_stream(self.device)
            after_forward = torch.cuda.Event()
            after_forward.record(forward)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(after_forward)
                self._gather_into(staged, page_views, idx.to(self.device, non_blocking=True))
                gathered = torch.cuda.Event()
                gathered.record(self.stream)
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
