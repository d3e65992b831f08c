"""Producer-side staging of a request's pages on the cache's device.

A move out of a device cache costs a constant number of device operations and host waits,
whatever its page count. :meth:`DeviceStager.gather` uploads the request's block ids once
(one non-blocking copy from pinned memory) and gathers the pages of every layer (one
``index_select`` each) into one reusable staging buffer laid out as the frame's data
section (layer after layer, each at the frame's alignment), on a side stream that first
waits for an event recorded after the forward pass; the forward stream then waits for the
gather, so blocks vLLM frees and reuses next step are never overwritten before they were read.

Packing: a frame tells each layer where it goes before filling any (``LazyTensor.place``),
and the first layer's fill copies the whole run of this frame's layers (a part holds some of
them) with one copy. Into host memory that copy is waited for once (the frame's bytes are
final when a reader sees them). Into device memory (a frame packed in a device pool) no
host wait: the side stream first waits for the packing thread's stream (the frame's zero
fill and header), and that stream then waits for the copy. The other layers' fills find
their bytes in place.

Stream operations come from :mod:`.device_order`: the device branch runs wherever the
device has them (tests install recording streams for the host and run it on host
tensors); without them the same code runs synchronously.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.cache_layout import bits
from vllm_omni_kv.kvcache.device_order import Streams, mark, streams_of
from vllm_omni_kv.kvcache.device_scratch import MoveScratch
from vllm_omni_kv.wire.prelude import align_up

#: default bound on the device memory all staging buffers of one stager may hold
DEFAULT_STAGING_BYTES = 256 << 20
#: the smallest staging buffer; bigger ones double, so similar requests reuse one
GRANULE = 2 << 20


def _rounded(n: int) -> int:
    """The buffer size for ``n`` bytes: ``GRANULE`` doubled until it holds them."""
    size = GRANULE
    while size < n:
        size *= 2
    return size


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


Fill = Callable[[torch.Tensor], Iterator[int]]
Place = Callable[[torch.Tensor], None]
#: one staged tensor: its shape, dtype and ``gather(ids on the device, out)``
Part = tuple[tuple[int, ...], torch.dtype, Callable[[torch.Tensor, torch.Tensor], None]]


def _pages(pv: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Gather of whole pages of ``pv`` (one ``index_select``)."""

    def run(idx: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(bits(pv), 0, idx, out=bits(out))

    return run


def layer_callbacks(staged: StagedPages | None, i: int, other: Fill) -> tuple[Fill, Place | None]:
    """Layer ``i``'s fill and place callbacks: from ``staged``, else ``other`` (no place)."""
    return (other, None) if staged is None else (staged.fill(i), staged.place(i))


@dataclass(frozen=True)
class _Slice:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _byte_region(first: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` bytes from the first byte of ``first`` as one ``uint8`` tensor (None when
    they do not lie in memory ``first`` can address: its storage, or host memory)."""
    storage = first.untyped_storage()
    start = first.data_ptr() - storage.data_ptr()
    if 0 <= start and start + nbytes <= storage.nbytes():
        out = torch.empty(0, dtype=torch.uint8, device=first.device)
        return out.set_(storage, start, (nbytes,), (1,))
    if first.device.type == "cpu":  # a view of part of a buffer (a frame in shared memory)
        raw = (ctypes.c_char * nbytes).from_address(first.data_ptr())
        return torch.frombuffer(raw, dtype=torch.uint8)
    return None


class StagedPages:
    """One request's pages of every layer, gathered into one staging buffer.

    ``fill(i)`` is the frame-filling callback of layer ``i`` and ``place(i)`` the callback
    that learns its destination; the buffer returns to its stager once every layer was
    copied out or :meth:`close` is called.
    """

    def __init__(self, stager: DeviceStager, buf: torch.Tensor, slices: list[_Slice | None]):
        self._stager = stager
        self._buf: torch.Tensor | None = buf
        self._slices = slices
        self._order = [i for i, s in enumerate(slices) if s is not None]
        self._pending = set(self._order)
        self._placed: dict[int, torch.Tensor] = {}
        self._copied: set[int] = set()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, stager._give_back, buf)
        #: copies out of the staging buffer so far (one per frame, or one per layer
        #: where a frame did not place its layers)
        self.copies = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slices if s is not None)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s gathered pages (a view into the staging buffer)."""
        s = self._slices[i]
        if s is None or self._buf is None:
            raise ConfigError(f"layer {i} has no staged pages (skipped layer or closed)")
        return self._buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def place(self, i: int) -> Callable[[torch.Tensor], None]:
        """The callback a frame calls with layer ``i``'s destination before any fill."""

        def run(dst: torch.Tensor) -> None:
            with self._lock:
                self._placed[i] = dst

        return run

    def fill(self, i: int) -> Callable[[torch.Tensor], Iterator[int]]:
        """The callback that copies layer ``i`` into ``dst`` (host or device memory), with
        the layers placed after it in the same frame."""

        def run(dst: torch.Tensor) -> Iterator[int]:
            with self._lock:
                copied = i in self._copied
            if not copied:
                self._copy(i, dst)
            self._done(i)
            yield dst.numel() * dst.element_size()

        return run

    def _run(self, i: int, dst: torch.Tensor) -> list[int]:
        """Layer ``i`` and the layers after it that the frame placed where the staging
        buffer has them relative to ``i`` (one copy moves them all); marked copied."""
        with self._lock:
            run = [i]
            mine = self._placed.get(i)
            if mine is not None and mine.data_ptr() == dst.data_ptr() and dst.is_contiguous():
                base = self._slices[i]
                assert base is not None
                for j in self._order[self._order.index(i) + 1 :]:
                    p, s = self._placed.get(j), self._slices[j]
                    assert s is not None
                    if (
                        p is None
                        or j in self._copied
                        or p.device != dst.device
                        or not p.is_contiguous()
                        or p.data_ptr() - dst.data_ptr() != s.offset - base.offset
                    ):
                        break
                    run.append(j)
            for j in run:
                self._placed.pop(j, None)
            self._copied.update(run)
            return run

    def _copy(self, i: int, dst: torch.Tensor) -> None:
        streams = self._stager.streams
        if streams is None:
            bits(dst).copy_(bits(self.layer(i)))
            with self._lock:
                self._copied.add(i)
            return
        run = self._run(i, dst)
        first, last = self._slices[run[0]], self._slices[run[-1]]
        assert first is not None and last is not None and self._buf is not None
        nbytes = last.offset + last.nbytes - first.offset
        out = _byte_region(dst, nbytes) if len(run) > 1 else None
        if out is None:
            with self._lock:
                self._copied.difference_update(run[1:])
            self._copy_out(streams, bits(self.layer(i)), bits(dst))
        else:
            self._copy_out(streams, self._buf[first.offset : first.offset + nbytes], out)

    def _copy_out(self, streams: Streams, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` on the stager's side stream (after the gather, which
        was queued there): into device memory ordered both ways with the packing
        thread's stream, into host memory waited for."""
        stream = self._stager.side
        assert stream is not None
        self.copies += 1
        on_device = dst.device.type != "cpu" or dst.device == self._stager.device
        packer = streams.current(dst.device) if on_device else None
        with streams.use(stream):
            if packer is not None:  # after the frame's zero fill and header
                stream.wait_stream(packer)
            dst.copy_(src, non_blocking=dst.is_pinned() or on_device)
            done = streams.event()
            done.record(stream)
        if packer is not None:
            packer.wait_event(done)  # the frame's next use sees these layers
        else:
            done.synchronize()  # the bytes are final when a layer is reported packed

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
        self._scratch = None if self.streams is None else MoveScratch(self.device, self.streams)
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
            want = max(nbytes, min(_rounded(nbytes), self.max_bytes))
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

    def _layout(self, parts: Sequence[Part | None]) -> list[_Slice | None]:
        """Each part's place in the staging buffer: as in a frame's data section."""
        slices: list[_Slice | None] = []
        off = 0
        for part in parts:
            if part is None:
                slices.append(None)
                continue
            shape, dtype, _gather = part
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            slices.append(_Slice(off, shape, dtype, nbytes))
            off = align_up(off + nbytes)
        return slices

    def gather(
        self, page_views: Sequence[torch.Tensor | None], ids: Sequence[int]
    ) -> StagedPages | None:
        """Stage pages ``ids`` of every layer's page view (``[blocks, *page]``), ordered
        after the work already queued on the current stream. None when it does not fit."""
        parts: list[Part | None] = []
        for pv in page_views:
            if pv is not None and pv.device != self.device:
                raise ConfigError(f"a page view on {pv.device} given to the {self.device} stager")
            parts.append(None if pv is None else ((len(ids), *pv.shape[1:]), pv.dtype, _pages(pv)))
        return self.stage(parts, ids)

    def stage(self, parts: Sequence[Part | None], ids: Sequence[int]) -> StagedPages | None:
        """Stage ``parts`` (each ``(shape, dtype, gather(ids, out))``, ``ids`` uploaded once
        and handed to every gather as a device tensor) into one buffer laid out as a frame's
        data section, ordered after the work already queued on the current stream. None
        when they do not fit."""
        slices = self._layout(parts)
        total = max((s.offset + s.nbytes for s in slices if s is not None), default=0)
        buf = self._take(max(total, 1))
        if buf is None:
            self.fallbacks += 1
            return None
        staged = StagedPages(self, buf, slices)
        gaps = any(s.nbytes != align_up(s.nbytes) for s in slices if s is not None)
        padded = buf[:total] if gaps else None
        if self.streams is None or self.side is None or self._scratch is None:
            idx = torch.tensor(list(ids), dtype=torch.long, device=self.device)
            self._gather_into(staged, parts, idx, padded)
        else:
            after_forward = mark(self.streams, self.device)
            forward = self.streams.current(self.device)
            with self.streams.use(self.side), self._scratch.use() as scratch:
                self.side.wait_event(after_forward)
                self._gather_into(staged, parts, scratch.ids(ids), padded)
                gathered = self.streams.event()
                gathered.record(self.side)
            forward.wait_event(gathered)  # blocks freed after this step are read first
        self.gathers += 1
        return staged

    @staticmethod
    def _gather_into(
        staged: StagedPages,
        parts: Sequence[Part | None],
        idx: torch.Tensor,
        padded: torch.Tensor | None,
    ) -> None:
        if padded is not None:  # the frame's padding between layers is zeros
            padded.zero_()
        for i, part in enumerate(parts):
            if part is not None:
                part[2](idx, staged.layer(i))

    def close(self) -> None:
        """Drop the idle buffers (buffers in use return and stay until the next close)."""
        with self._lock:
            for b in self._free:
                self._held -= b.numel()
            self._free.clear()
