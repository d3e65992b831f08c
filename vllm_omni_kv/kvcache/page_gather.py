"""Gathering a request's pages out of a paged cache: runs of consecutive blocks, one
``memmove`` per run on the host (in steps, so a packer hashes bytes still in cache)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence

import torch

from vllm_omni_kv.kvcache.cache_layout import bits, dense_pages
from vllm_omni_kv.wire.codec import PACK_STEP

#: gathers report progress about this often, so the packer hashes bytes still in cache
STEP_BYTES = PACK_STEP


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset in ids, first block id, length)`` of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for off, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            o, first, n = runs[-1]
            runs[-1] = (o, first, n + 1)
        else:
            runs.append((off, b, 1))
    return runs


def addressable(pv: torch.Tensor) -> tuple[int, int] | None:
    """``(page bytes, page stride in bytes)`` when pages of ``pv`` are host memory runs."""
    if not dense_pages(pv):
        return None
    return pv[0].numel() * pv.element_size(), pv.stride(0) * pv.element_size()


def iter_gather_pages(pv: torch.Tensor, ids: Sequence[int], out: torch.Tensor) -> Iterator[int]:
    """Copy pages ``ids`` of ``pv`` (a page view) into ``out``, yielding bytes written so far.

    Host pages are one ``memmove`` per page run (split into ``STEP_BYTES`` steps), so
    a caller can checksum each step while it is in cache; others one ``index_select``.
    """
    addr = addressable(pv) if out.device.type == "cpu" and out.is_contiguous() else None
    if addr is None:
        idx = torch.tensor(list(ids), dtype=torch.long, device=pv.device)
        if out.device == pv.device:
            torch.index_select(bits(pv), 0, idx, out=bits(out))
        else:  # e.g. a GPU cache packed into host memory
            bits(out).copy_(torch.index_select(bits(pv), 0, idx))
        yield out.numel() * out.element_size()
        return
    per, stride = addr
    step = max(1, STEP_BYTES // per)
    base, dst = pv.data_ptr(), out.data_ptr()
    reported = 0
    for off, first, n in (
        block_runs(ids) if stride == per else [(i, b, 1) for i, b in enumerate(ids)]
    ):
        for j in range(0, n, step):
            k = min(step, n - j)
            ctypes.memmove(dst + (off + j) * per, base + (first + j) * stride, k * per)
            if off + j + k - reported >= step:  # report about every STEP_BYTES
                reported = off + j + k
                yield reported * per
    if reported < len(ids):
        yield len(ids) * per


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory of ``t`` (from its first to its last byte)."""
    n = (t.shape[0] - 1) * t.stride(0) * t.element_size() + t[0].numel() * t.element_size()
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    return memoryview(buf).cast("B")
