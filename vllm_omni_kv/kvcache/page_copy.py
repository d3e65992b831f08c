"""Runs of pages copied between two host caches, one native call per layer.

The copies go through the ``_pagecopy`` extension (built with the package; C, no
Python objects touched while copying, GIL released). Copies of 1 MiB or more use streaming
(non-temporal) stores: the destination lines are written without being read first,
which is how a large ``memcpy`` reaches memory bandwidth; glibc only does so above
its own threshold (hundreds of MiB on some hosts), which one 128 KiB KV page never
reaches. Where the extension could not be built, the same copies run as a Python
loop of ``ctypes.memmove`` calls (about 10% slower, and without streaming stores).
"""

from __future__ import annotations

import ctypes
import importlib
from array import array
from collections.abc import Sequence
from types import ModuleType

from vllm_omni_kv.errors import KVPayloadError


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("vllm_omni_kv.kvcache._pagecopy")
    except ImportError:  # an install without a C compiler: the memmove loop below
        return None


_native = _load()

#: a copy of at least this many bytes (all layers) uses streaming stores. Moves copy
#: pages scattered over a cache far larger than them, whose lines are rarely in cache:
#: there streaming stores beat cached ones (which read each destination line first) from
#: one 128 KiB page per layer up (``one_copy_bench.py``'s profile has both)
STREAM_MIN_BYTES = 1 << 20

Run = tuple[int, int, int]  # (source page, destination page, pages)


def pack_runs(runs: Sequence[Run]) -> array:  # type: ignore[type-arg]
    """``runs`` as the flat int64 table :func:`copy_runs` takes (build once, copy per layer)."""
    return array("q", [x for run in runs for x in run])


def native_copy() -> str | None:
    """How the native copy works on this CPU; None when the extension is missing."""
    return None if _native is None else str(_native.features())


def copy_runs(
    dst: tuple[int, int, int],
    src: tuple[int, int, int],
    per: int,
    runs: array,  # type: ignore[type-arg]
    stream: bool,
) -> int:
    """Copy ``runs`` (:func:`pack_runs`) of ``per``-byte pages from ``src`` to ``dst``,
    each given as ``(base address, page stride in bytes, pages)``; returns bytes copied.
    Every run is checked against both caches first (``KVPayloadError``: nothing is
    copied)."""
    (d_base, d_stride, d_pages), (s_base, s_stride, s_pages) = dst, src
    if runs.typecode != "q" or len(runs) % 3:
        raise KVPayloadError("page copy refused: runs must be int64 (src, dst, pages) triples")
    if _native is not None:
        try:
            return int(
                _native.copy_runs(
                    d_base, d_stride, d_pages, s_base, s_stride, s_pages, per,
                    runs.buffer_info()[0], len(runs) // 3, stream,
                )
            )  # fmt: skip
        except ValueError as e:
            raise KVPayloadError(f"page copy refused: {e}") from None
    triples = [(runs[i], runs[i + 1], runs[i + 2]) for i in range(0, len(runs), 3)]
    if per <= 0 or d_stride < per or s_stride < per:
        raise KVPayloadError(f"page copy refused: strides {d_stride}/{s_stride}, page {per}")
    for s, d, n in triples:
        if min(s, d, n) < 0 or s + n > s_pages or d + n > d_pages:
            raise KVPayloadError(
                f"page copy refused: run ({s}, {d}, {n}) outside caches of {s_pages} / "
                f"{d_pages} pages"
            )
    memmove = ctypes.memmove
    moved = 0
    contiguous = d_stride == per == s_stride
    for s, d, n in triples:
        if contiguous:
            memmove(d_base + d * per, s_base + s * per, n * per)
        else:
            for j in range(n):
                memmove(d_base + (d + j) * d_stride, s_base + (s + j) * s_stride, per)
        moved += n * per
    return moved
