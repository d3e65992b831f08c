"""``PayloadStream.copy_into``: frame ranges copied to host memory, each chunk verified.

Expected bytes come from the source tensor itself (``torch`` byte views), never from the
stream under test.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vllm_omni_kv.errors import KVPayloadError, KVTransferCancelled, KVTransferError
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import ArrivedFrameStream, CompleteStream, CopyOut

CHUNK = 4096
NBYTES = 40 * CHUNK + 1000  # 41 chunks, the last one short


def _frame() -> tuple[bytearray, int, bytes]:
    """A frame of one uint8 tensor; ``(frame bytes, tensor start, tensor bytes)``."""
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g)
    f = codec.encode({"t": t}, chunk_bytes=CHUNK)
    raw = bytearray(f.to_bytearray())
    start = f.data_start + f.tensor_table[0][2]
    return raw, start, bytes(t.numpy().tobytes())


def _dest(n: int) -> tuple[np.ndarray, memoryview]:
    buf = np.zeros(n, dtype=np.uint8)
    return buf, memoryview(buf).cast("B")


def _copies(
    start: int, ranges: list[tuple[int, int]], dst_offsets: list[int], dst: np.ndarray
) -> list[CopyOut]:
    mv = memoryview(dst).cast("B")
    out: list[CopyOut] = []
    for (a, b), d in zip(ranges, dst_offsets, strict=True):
        out.append((start + a, start + b, dst.ctypes.data + d, mv[d : d + b - a]))
    return out


def _deadline() -> float:
    return time.monotonic() + 5


def test_copies_land_where_asked_block_aligned_and_straddling() -> None:
    raw, start, ref = _frame()
    dst, _ = _dest(NBYTES)
    # whole chunks, a run of three chunks, ranges that start and end inside chunks, the tail
    ranges = [(0, CHUNK), (3 * CHUNK, 6 * CHUNK), (7 * CHUNK + 100, 9 * CHUNK - 5)]
    ranges.append((39 * CHUNK, NBYTES))
    offsets = [NBYTES - CHUNK, 0, 5 * CHUNK, 10 * CHUNK]  # scattered destinations
    stream = ArrivedFrameStream(raw)
    stream.copy_into(_copies(start, ranges, offsets, dst), _deadline())
    for (a, b), d in zip(ranges, offsets, strict=True):
        assert dst[d : d + b - a].tobytes() == ref[a:b]


@pytest.mark.parametrize(
    "flip, ranges",
    [
        (5 * CHUNK + 17, [(5 * CHUNK, 6 * CHUNK)]),  # inside a chunk one copy covers whole
        (8 * CHUNK + 500, [(7 * CHUNK + 100, 8 * CHUNK + 10)]),  # a straddled chunk's rest
        (40 * CHUNK + 999, [(40 * CHUNK, NBYTES)]),  # the short last chunk
    ],
)
def test_a_corrupt_chunk_fails_the_copy(flip: int, ranges: list[tuple[int, int]]) -> None:
    raw, start, _ref = _frame()
    raw[start + flip] ^= 0x5A
    dst, _ = _dest(NBYTES)
    stream = ArrivedFrameStream(raw)
    with pytest.raises(KVPayloadError, match="checksum mismatch"):
        stream.copy_into(_copies(start, ranges, [0] * len(ranges), dst), _deadline())


def test_corruption_outside_the_copied_chunks_is_not_read() -> None:
    raw, start, ref = _frame()
    raw[start + 2 * CHUNK + 1] ^= 0xFF  # chunk 2: not requested
    dst, _ = _dest(NBYTES)
    stream = ArrivedFrameStream(raw)
    stream.copy_into(_copies(start, [(4 * CHUNK, 6 * CHUNK)], [0], dst), _deadline())
    assert dst[: 2 * CHUNK].tobytes() == ref[4 * CHUNK : 6 * CHUNK]


def test_bad_copy_lists_are_refused() -> None:
    raw, start, _ref = _frame()
    dst, _ = _dest(NBYTES)
    unsorted = _copies(start, [(2 * CHUNK, 3 * CHUNK), (0, CHUNK)], [0, CHUNK], dst)
    with pytest.raises(KVTransferError, match="sorted, disjoint"):
        ArrivedFrameStream(raw).copy_into(unsorted, _deadline())
    a, b, addr, view = _copies(start, [(0, CHUNK)], [0], dst)[0]
    with pytest.raises(KVTransferError, match="sorted, disjoint"):  # view size != range
        ArrivedFrameStream(raw).copy_into([(a, b, addr, view[:10])], _deadline())
    with pytest.raises(KVTransferError, match="not tensor data"):  # the header
        hdr = memoryview(dst).cast("B")[:16]
        ArrivedFrameStream(raw).copy_into([(0, 16, dst.ctypes.data, hdr)], _deadline())
    with pytest.raises(KVTransferError, match="outside"):
        end = len(raw) + 10
        big, big_mv = _dest(end - start)
        copy = (start, end, big.ctypes.data, big_mv)
        ArrivedFrameStream(raw).copy_into([copy], _deadline())


def test_a_stream_is_read_once_and_cancel_is_honoured() -> None:
    raw, start, _ref = _frame()
    dst, _ = _dest(NBYTES)
    stream = ArrivedFrameStream(raw)
    stream.copy_into(_copies(start, [(0, CHUNK)], [0], dst), _deadline())
    with pytest.raises(KVTransferError, match="only once"):
        list(stream.load(None, _deadline()))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(KVTransferCancelled):
        ArrivedFrameStream(raw).copy_into(
            _copies(start, [(0, CHUNK)], [0], dst), _deadline(), cancel
        )


def test_streams_without_a_frame_address_say_so() -> None:
    dst, mv = _dest(16)
    with pytest.raises(KVTransferError, match="use load"):
        CompleteStream({"x": 1}, 10).copy_into([(0, 16, dst.ctypes.data, mv)], _deadline())


def test_copies_count_as_moved_bytes_once_per_chunk() -> None:
    raw, start, _ref = _frame()
    dst, _ = _dest(NBYTES)
    stream = ArrivedFrameStream(raw)
    stream.count_chunks = True
    # two copies inside chunk 1: the chunk is counted (and verified) once
    ranges = [(CHUNK, CHUNK + 10), (CHUNK + 20, CHUNK + 30)]
    before = stream.moved
    stream.copy_into(_copies(start, ranges, [0, 100], dst), _deadline())
    assert stream.moved - before == CHUNK
