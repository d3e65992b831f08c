"""The movers: the bytes of a :class:`~vllm_omni_kv.kvcache.move_plan.MovePlan`, moved
the way its two memory kinds allow, with a fixed number of operations per move.

Which mover runs is decided by the stream interface, not by the tensors: a side with
stream operations (:func:`~vllm_omni_kv.kvcache.device_order.streams_of` is not None:
CUDA, or the host where a test installed recording streams) is a device side.

- host -> host (:class:`HostMover`): one native call per layer (``page_copy.copy_runs``:
  C, GIL released, streaming stores for large moves); with digests, steps of about
  ``VERIFY_STEP`` bytes, each verified while in cache.
- device -> device (:class:`DeviceMover`): per layer one gather and one scatter over the
  whole move (``index_select`` / ``index_copy_`` on byte rows: any dtype), with the
  plan's page ids uploaded once.
- host -> device (:class:`HostToDeviceMover`): the host pages gathered natively into one
  staging buffer (pinned for CUDA; digests checked there), one upload, one scatter per
  layer.
- device -> host (:class:`DeviceToHostMover`): one gather per layer into one device
  buffer, one download into pinned memory, one host wait, then the native scatter.

Device work is queued on the calling thread's side stream after an event of its current
(the forward's) stream; the current stream then waits for the move, so whatever the
caller queues or waits for afterwards sees the pages written. A device-side move waits on
the host only where it must (digests, a download, or ``wait=True``): at most once.
With digests the written device pages are gathered into one buffer and copied to the
host once, then hashed there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache import page_kernel
from vllm_omni_kv.kvcache.cache_layout import dense_pages
from vllm_omni_kv.kvcache.device_order import Streams, mark, streams_of
from vllm_omni_kv.kvcache.move_plan import MovePlan
from vllm_omni_kv.kvcache.page_copy import STREAM_MIN_BYTES, copy_runs, pack_runs
from vllm_omni_kv.kvcache.page_digests import page_digests, verify_digests

#: verified host copies are split in steps of about this size, each verified while in cache
VERIFY_STEP = 1 << 20

Slot = tuple[int, int, int]  # (group index, layer, byte offset in the staging buffer)
Native = tuple[int, int, int]  # a host page view as (base address, page stride, pages)


class Mover(Protocol):
    """Moves a plan's pages; returns bytes moved. ``wait``: return only once the pages
    are written (a device move otherwise returns once it is queued)."""

    def move(self, plan: MovePlan, wait: bool = False) -> int: ...


def byte_rows(pv: torch.Tensor) -> torch.Tensor:
    """``pv`` (``[pages, ...]``) with its last dimension as bytes; ``[pages, page bytes]``
    for dense pages. Gathers and scatters of it move bytes whatever the dtype."""
    rows = pv
    if pv.element_size() != 1 or pv.dtype != torch.uint8:
        try:
            rows = pv.view(torch.uint8)
        except RuntimeError:  # the last dimension is strided: index the typed view
            return pv
    return rows.flatten(1) if dense_pages(pv, host=False) and pv.dim() > 2 else rows


def _native(pv: torch.Tensor, per: int) -> Native | None:
    """``(base, page stride, pages)`` of a host page view the native copy can address."""
    if not pv.is_cpu or not dense_pages(pv, host=False):
        return None
    stride = pv.stride(0) * pv.element_size()
    return None if stride < per else (pv.data_ptr(), stride, int(pv.shape[0]))


def _slots(plan: MovePlan) -> tuple[list[Slot], int]:
    """Each (group, layer)'s place in one staging buffer of the move's pages, in pair
    order; and its size."""
    slots, off = [], 0
    for gi, g in enumerate(plan.groups):
        for layer in g.layers:
            slots.append((gi, layer, off))
            off += len(g.pairs) * plan.page_bytes(layer)
    return slots, off


def _rows_of(buf: torch.Tensor, off: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """``n`` rows shaped like ``like``'s (a :func:`byte_rows`) at byte ``off`` of ``buf``."""
    shape = like.shape[1:]
    size = n * int(torch.Size(shape).numel()) * like.element_size()
    return buf[off : off + size].view(like.dtype).view(n, *shape)


def _buffer(nbytes: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
    pin = pinned and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def _check_staged(plan: MovePlan, host: torch.Tensor, slots: Sequence[Slot]) -> None:
    """Verify the pages staged in ``host`` (pair order) against the plan's digests."""
    for gi, layer, off in slots:
        sums = plan.digests(layer)
        if sums is None:
            continue
        g, per = plan.groups[gi], plan.page_bytes(layer)
        pages = host[off : off + len(g.pairs) * per].view(len(g.pairs), per)
        verify_digests(page_digests(pages, range(len(g.pairs))), sums, g.first, layer, plan.what)


class HostMover:
    """host -> host: the native copy, one call per layer."""

    def move(self, plan: MovePlan, wait: bool = False) -> int:
        """Every layer's addresses first, then the unverified native copies back to back
        (no Python work between them evicts what the next copy reads)."""
        stream = plan.nbytes >= STREAM_MIN_BYTES
        native: list[tuple[Native, Native, int, Any]] = []
        moved = 0
        for gi, g in enumerate(plan.groups):
            for layer in g.layers:
                per = plan.page_bytes(layer)
                s, d = _native(plan.src[layer], per), _native(plan.dst[layer], per)
                if s is not None and d is not None and plan.digests(layer) is None:
                    native.append((d, s, per, g.table))
                else:
                    moved += self._layer(plan, gi, layer, s, d)
        for d, s, per, table in native:
            moved += copy_runs(d, s, per, table, stream)
        return moved

    def _layer(
        self, plan: MovePlan, gi: int, layer: int, s: Native | None, d: Native | None
    ) -> int:
        """A layer with strided pages (one gather and scatter) or digests to verify."""
        g, per = plan.groups[gi], plan.page_bytes(layer)
        sp, dp, sums = plan.src[layer], plan.dst[layer], plan.digests(layer)
        if s is None or d is None:  # strided pages: one gather and scatter
            si, di = plan.indices(sp.device)[gi]
            byte_rows(dp).index_copy_(0, di, byte_rows(sp).index_select(0, si))
            if sums is not None:
                got = page_digests(dp, [b for _, b in g.pairs])
                verify_digests(got, sums, g.first, layer, plan.what)
            return len(g.pairs) * per
        assert sums is not None  # an unverified native layer is copied by move()
        step = max(1, VERIFY_STEP // per) if s[1] == per == d[1] else 1
        for i0, s0, d0, n in g.runs:
            for j in range(0, n, step):
                k = min(step, n - j)
                ctypes.memmove(d[0] + (d0 + j) * d[1], s[0] + (s0 + j) * s[1], k * per)
                got = page_digests(dp, range(d0 + j, d0 + j + k))
                verify_digests(got, sums, g.first + i0 + j, layer, plan.what)
        return len(g.pairs) * per


def _uploaded(plan: MovePlan, q: _Queued, dev: torch.device) -> None:
    """The plan's page ids uploaded to ``dev`` on the move's side stream (built on the
    host first, outside it)."""
    plan.host_ids(pin=dev.type == "cuda")
    with q.streams.use(q.side):
        plan.upload(dev)


class _Queued:
    """A device move's ordering: queued on the side stream of ``device`` after the
    current stream's work; on leaving the ``with`` block (even by an error: its buffers
    go back to the current stream's pool) the current stream waits for it."""

    def __init__(self, streams: Streams, device: torch.device) -> None:
        self.streams, self.device = streams, device
        self.side = streams.side(device)
        self.side.wait_event(mark(streams, device))
        self.done = streams.event()

    def __enter__(self) -> _Queued:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.record(self.side)
        self.streams.current(self.device).wait_event(self.done)

    def wait(self, host_wait: bool) -> None:
        """Wait on the host for the move (one wait) where ``host_wait``."""
        if host_wait:
            self.done.synchronize()


class DeviceMover:
    """device -> device: per layer one gather into one scratch buffer of the move and one
    scatter out of it (or one Triton launch over every layer,
    :mod:`~vllm_omni_kv.kvcache.page_kernel`); with digests, one gather of the written
    pages and one download."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def move(self, plan: MovePlan, wait: bool = False) -> int:
        dev = plan.dst[0].device
        if any(t.device != dev for t in plan.src):
            raise ConfigError(
                f"pages on {plan.src[0].device} cannot move to {dev} in one plan: open the "
                "producer's memory on the destination's device"
            )
        if page_kernel.usable(plan, dev):
            try:
                return self._move(plan, wait, page_kernel.tables(plan, dev))
            except page_kernel.KernelFailed:
                pass  # nothing was queued; the kernel is off from now on (logged)
        return self._move(plan, wait, None)

    def _move(self, plan: MovePlan, wait: bool, kernel: page_kernel.Tables | None) -> int:
        dev = plan.dst[0].device
        slots, size = _slots(plan)
        check = [k for k, (_gi, layer, _off) in enumerate(slots) if plan.digests(layer) is not None]
        indexed = kernel is None or bool(check)  # gathers / scatters run
        scratch = _buffer(size if indexed else 0, dev)  # pages in pair order, as bytes
        src, dst, picked, placed = _views(plan, slots, scratch) if indexed else ([], [], [], [])
        host = _buffer(size, torch.device("cpu"), dev.type == "cuda") if check else None
        q = _Queued(self.streams, dev)
        if indexed:
            _uploaded(plan, q, dev)
        by_group = plan.indices(dev) if indexed else []
        ids = [by_group[gi] for gi, _layer, _off in slots] if indexed else []
        with q, self.streams.use(q.side):  # only kernels from here on: views are made above
            if kernel is not None:  # one launch over every layer
                page_kernel.launch(plan, *kernel)
            else:
                for k in range(len(slots)):
                    torch.index_select(src[k], 0, ids[k][0], out=picked[k])
                for k in range(len(slots)):
                    dst[k].index_copy_(0, ids[k][1], placed[k])
            if host is not None:  # the written pages, gathered back, downloaded once
                for k in check:
                    torch.index_select(dst[k], 0, ids[k][1], out=placed[k])
                host.copy_(scratch, non_blocking=True)
        q.wait(wait or host is not None)
        if host is not None:
            _check_staged(plan, host, slots)
        return plan.nbytes


def _views(
    plan: MovePlan, slots: Sequence[Slot], scratch: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per slot: the source and destination byte rows, and the slot of ``scratch`` shaped
    like each (the same bytes: gathered as the source's rows, scattered as the
    destination's)."""
    src = [byte_rows(plan.src[layer]) for _gi, layer, _off in slots]
    dst = [byte_rows(plan.dst[layer]) for _gi, layer, _off in slots]
    n = [len(plan.groups[gi].pairs) for gi, _layer, _off in slots]
    offs = [off for _gi, _layer, off in slots]
    picked = [_rows_of(scratch, o, k, r) for o, k, r in zip(offs, n, src, strict=True)]
    placed = [_rows_of(scratch, o, k, r) for o, k, r in zip(offs, n, dst, strict=True)]
    return src, dst, picked, placed


class HostToDeviceMover:
    """host -> device: a native gather into one (pinned) buffer, one upload, one scatter
    per layer."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def move(self, plan: MovePlan, wait: bool = False) -> int:
        dev = plan.dst[0].device
        slots, size = _slots(plan)
        host = _buffer(size, torch.device("cpu"), dev.type == "cuda")
        for gi, layer, off in slots:  # host work: gathered (and verified) before queueing
            g, per, sp = plan.groups[gi], plan.page_bytes(layer), plan.src[layer]
            s = _native(sp, per)
            if s is None:
                out = _rows_of(host, off, len(g.pairs), byte_rows(sp))
                torch.index_select(byte_rows(sp), 0, plan.indices(sp.device)[gi][0], out=out)
            else:
                runs = pack_runs([(s0, i0, n) for i0, s0, _d0, n in g.runs])
                copy_runs((host.data_ptr() + off, per, len(g.pairs)), s, per, runs, False)
        _check_staged(plan, host, slots)
        dst_rows = [byte_rows(t) for t in plan.dst]
        q = _Queued(self.streams, dev)
        _uploaded(plan, q, dev)
        ids = plan.indices(dev)
        staged = host if dev.type == "cpu" else _buffer(size, dev)
        rows = [_rows_of(staged, off, len(plan.groups[gi].pairs), dst_rows[layer])
                for gi, layer, off in slots]  # fmt: skip
        with q, self.streams.use(q.side):
            if staged is not host:
                staged.copy_(host, non_blocking=True)  # the one upload
            for (gi, layer, _off), r in zip(slots, rows, strict=True):
                dst_rows[layer].index_copy_(0, ids[gi][1], r)
        q.wait(wait)
        return plan.nbytes


class DeviceToHostMover:
    """device -> host: one gather per layer into one device buffer, one download, one
    host wait, then the native scatter."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def move(self, plan: MovePlan, wait: bool = False) -> int:
        dev = plan.src[0].device
        slots, size = _slots(plan)
        staged = _buffer(size, dev)
        host = _buffer(size, torch.device("cpu"), dev.type == "cuda")
        src_rows = [byte_rows(t) for t in plan.src]
        q = _Queued(self.streams, dev)
        _uploaded(plan, q, dev)
        ids = plan.indices(dev)
        outs = [_rows_of(staged, off, len(plan.groups[gi].pairs), src_rows[layer])
                for gi, layer, off in slots]  # fmt: skip
        with q, self.streams.use(q.side):
            for (gi, layer, _off), out in zip(slots, outs, strict=True):
                torch.index_select(src_rows[layer], 0, ids[gi][0], out=out)
            host.copy_(staged, non_blocking=True)
        q.wait(True)
        _check_staged(plan, host, slots)
        for gi, layer, off in slots:
            g, per, dp = plan.groups[gi], plan.page_bytes(layer), plan.dst[layer]
            d = _native(dp, per)
            if d is None:
                rows = _rows_of(host, off, len(g.pairs), byte_rows(dp))
                byte_rows(dp).index_copy_(0, plan.indices(dp.device)[gi][1], rows)
            else:
                runs = pack_runs([(i0, d0, n) for i0, _s0, d0, n in g.runs])
                copy_runs(d, (host.data_ptr() + off, per, len(g.pairs)), per, runs, False)
        return plan.nbytes


def mover_for(src: torch.device, dst: torch.device) -> Mover:
    """The mover for pages from ``src`` memory to ``dst`` memory."""
    s, d = streams_of(src), streams_of(dst)
    if d is not None:
        return DeviceMover(d) if s is not None else HostToDeviceMover(d)
    return DeviceToHostMover(s) if s is not None else HostMover()


def move(plan: MovePlan, wait: bool = False) -> int:
    """Move ``plan``'s pages with the mover for its memory kinds; bytes moved.
    ``KVPayloadError`` where a written page does not match its digest."""
    if not plan.groups:
        return 0
    i = plan.groups[0].layers[0]
    return mover_for(plan.src[i].device, plan.dst[i].device).move(plan, wait)
