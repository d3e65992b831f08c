"""One move plan, one mover per pair of memory kinds: operations per move do not grow
with the page count, bytes are exact.

The device branch runs on host tensors with ``RecordingStreams`` installed for "cpu"
(the mover is chosen by the stream interface, not by ``tensor.is_cuda``), which records
every torch call queued on a stream ("work") and every host wait. Expected bytes come
from a plain per-page loop over the tensors, digests from xxhash directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import xxhash
from _kv_fixtures import ShmRegions, shm_namespace
from _mp import CTX

from vllm_omni_kv import KVPayloadError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.move_plan import MovePlan, Pages
from vllm_omni_kv.kvcache.movers import (
    DeviceMover,
    DeviceToHostMover,
    HostMover,
    HostToDeviceMover,
    move,
)
from vllm_omni_kv.kvcache.shared_pages import PageCopy, layer_geometry
from vllm_omni_kv.testing.fake_streams import RecordingStreams

LAYERS, BLOCKS, HEADS, BS, DIM = 4, 2304, 2, 16, 4
SIZES = [4, 64, 1024]
IDENT = KVLayoutId("k_v", "LBHNC", "bfloat16", BS, BS, HEADS, DIM, 2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t


def _pages(seed: int, strided: bool = False) -> list[torch.Tensor]:
    """``LAYERS`` page views ``[BLOCKS, HEADS, BS, 2*DIM]`` bf16 of random bits: one
    allocation, layers interleaved per block (page stride ``LAYERS`` pages), or with a
    strided last dimension (pages not dense)."""
    g = torch.Generator().manual_seed(seed)
    width = 4 * DIM if strided else 2 * DIM
    raw = torch.randint(-(2**15), 2**15, (BLOCKS, LAYERS, HEADS, BS, width), generator=g)
    alloc = raw.to(torch.int16).view(torch.bfloat16)
    return [alloc[:, i, ..., : 2 * DIM] for i in range(LAYERS)]


def _pairs(n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` pairs of a long-running server's shuffled block tables (few runs)."""
    rng = random.Random(seed)
    return list(zip(rng.sample(range(BLOCKS), n), rng.sample(range(BLOCKS), n), strict=True))


def _expected(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> list[torch.Tensor]:
    want = [d.clone() for d in dst]
    for s, d in pairs:  # the reference: one page at a time
        for i in range(len(src)):
            want[i][d] = src[i][s]
    return want


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"layer {i} differs"


def _sums(src: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[list[int]]:
    return [
        [
            xxhash.xxh3_64_intdigest(p[s].contiguous().view(torch.uint8).numpy().data)
            for s, _ in pairs
        ]
        for p in src
    ]


def _counts(rs: RecordingStreams) -> tuple[int, int]:
    """``(work queued on any stream, host waits)``."""
    work = sum(k == "work" for s in rs.streams.values() for k, _ in s.ops)
    return work, len(rs.host_waits)


@pytest.fixture
def recording() -> Iterator[RecordingStreams]:
    with device_order.installed("cpu", RecordingStreams()) as rs:
        assert isinstance(rs, RecordingStreams)
        yield rs


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_device_moves_cost_the_same_at_every_page_count(strided: bool, digests: bool) -> None:
    counts = []
    for n in SIZES:
        src, dst, pairs = _pages(1, strided), _pages(2), _pairs(n, n)
        want = _expected(src, dst, pairs)
        with device_order.installed("cpu", RecordingStreams()) as rs:
            assert isinstance(rs, RecordingStreams)
            before = rs.work(rs.forward, "forward writes the pages")
            moved = move(MovePlan.whole(src, dst, pairs, _sums(src, pairs) if digests else None))
            after = rs.work(rs.forward, "forward reads the pages")
            side = rs.side_streams()
            assert len(side) == 1 and rs.queued(side[0], "index_copy_")
            assert rs.before(before, rs.queued(side[0], "index_select")[0])
            assert rs.before(rs.queued(side[0], "index_copy_")[-1], after)
            counts.append(_counts(rs))
        assert moved == n * LAYERS * HEADS * BS * 2 * DIM * 2
        _same(dst, want)
    assert counts[0] == counts[1] == counts[2], counts
    work, waits = counts[0][0] - 2, counts[0][1]  # less the test's two forward entries
    assert work <= 2 * LAYERS + (LAYERS + 1 if digests else 0) + 1, work  # + the id upload
    assert waits == (1 if digests else 0)  # the caller's own ordering covers a plain move


@pytest.mark.parametrize("mover", [HostToDeviceMover, DeviceToHostMover])
def test_staged_movers_cost_the_same_at_every_page_count(
    recording: RecordingStreams, mover: Callable[[Any], Any]
) -> None:
    counts = []
    for n in SIZES:
        src, dst, pairs = _pages(3), _pages(4, strided=n == 64), _pairs(n, n)
        want = _expected(src, dst, pairs)
        start = _counts(recording)
        mover(recording).move(MovePlan.whole(src, dst, pairs, _sums(src, pairs)))
        end = _counts(recording)
        counts.append((end[0] - start[0], end[1] - start[1]))
        _same(dst, want)
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0][0] <= 2 * LAYERS + 4 and counts[0][1] <= 1


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_host_moves_exact_bytes_per_group(strided: bool) -> None:
    src, dst = _pages(5, strided), _pages(6, strided)
    a, b = _pairs(64, 1), _pairs(9, 2)
    want = _expected(src[:2], dst[:2], a) + _expected(src[2:], dst[2:], b)
    sums = _sums(src[:2], a) + _sums(src[2:], b)
    plan = MovePlan(src, dst, [Pages([0, 1], a), Pages([2, 3], b)], sums)
    assert isinstance(device_order.streams_of("cpu"), type(None))
    assert HostMover().move(plan) == plan.nbytes == (2 * 64 + 2 * 9) * HEADS * BS * 2 * DIM * 2
    _same(dst, want)


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("bad", [(BLOCKS, 0), (0, BLOCKS), (-1, 3)])
def test_pages_outside_a_cache_are_refused_before_any_byte_moves(
    device: bool, bad: tuple[int, int]
) -> None:
    src, dst = _pages(7), _pages(8)
    before = [d.clone() for d in dst]
    pairs = [*_pairs(30, 3), bad]
    with pytest.raises(KVPayloadError, match="outside a cache"):
        if device:
            with device_order.installed("cpu", RecordingStreams()):
                move(MovePlan.whole(src, dst, pairs))
        else:
            move(MovePlan.whole(src, dst, pairs))
    _same(dst, before)


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_a_page_rewritten_while_read_fails_its_digest(device: bool) -> None:
    src, dst, pairs = _pages(9), _pages(10), _pairs(64, 4)
    sums = _sums(src, pairs)
    src[2][pairs[17][0]].view(torch.int16)[0, 0, 0] ^= 1  # the producer reused the block
    with pytest.raises(KVPayloadError, match="layer 2 page 17 does not match"):
        if device:
            with device_order.installed("cpu", RecordingStreams()) as rs:
                DeviceMover(rs).move(MovePlan.whole(src, dst, pairs, sums))
        else:
            move(MovePlan.whole(src, dst, pairs, sums))


def test_one_copy_out_of_a_real_shm_region_is_one_move() -> None:
    """Two parts (two layer groups) out of a producer's /dev/shm cache region, through
    the consumer region's copy_all, down the device branch: a constant count per move."""
    page = HEADS * BS * 2 * DIM * 2
    with shm_namespace("mp") as ns:
        r = ShmRegions(ns, LAYERS * BLOCKS * page, 11)
        try:
            views = [
                r.cache[i * BLOCKS * page : (i + 1) * BLOCKS * page]
                .view(torch.bfloat16)
                .view(BLOCKS, HEADS, BS, 2 * DIM)
                for i in range(LAYERS)
            ]
            assert r.region.tensor is not None
            exported = r.region.export(views)
            assert exported is not None
            desc, base, nbytes = exported
            geometry = layer_geometry(views, base, nbytes)
            assert geometry is not None
            counts = []
            for n in SIZES:
                mine = [p.clone() for p in _pages(12)]  # [BLOCKS, HEADS, BS, 2*DIM] views
                src = [page_view(v, IDENT) for v in views]
                dst = [page_view(v, IDENT) for v in mine]
                a, b = _pairs(n, n), _pairs(n, n + 1)
                want = _expected(src[:3], dst[:3], a) + _expected(src[3:], dst[3:], b)
                parts = [
                    PageCopy(geometry[:3], IDENT, mine[:3], a, _sums(src[:3], a), 0),
                    PageCopy(geometry[3:], IDENT, mine[3:], b, None, 0),
                ]
                with device_order.installed("cpu", RecordingStreams()) as rs:
                    assert isinstance(rs, RecordingStreams)
                    moved = r.reader.copy_all(desc, parts)
                    counts.append(_counts(rs))
                assert moved == 4 * n * page
                _same(dst, want)
            assert counts[0] == counts[1] == counts[2], counts
        finally:
            r.close()


def _kernel_moves(out: Any) -> None:
    """In a child with TRITON_INTERPRET=1: moves of 4 and 16 pages down the device branch
    take the Triton kernel; ``out`` gets ``(per size: (work, host waits), bytes exact)``."""
    from vllm_omni_kv.kvcache import page_kernel

    results = []
    for n in (4, 16):
        src, dst, pairs = _pages(13), _pages(14), _pairs(n, n)
        src, dst = src[:2], dst[:2]  # the interpreter runs each program in Python: keep it small
        want = _expected(src, dst, pairs)
        plan = MovePlan.whole(src, dst, pairs)
        assert page_kernel.usable(plan, torch.device("cpu"))
        with device_order.installed("cpu", RecordingStreams()) as rs:
            assert isinstance(rs, RecordingStreams)
            move(plan)
            assert not rs.queued(rs.side_streams()[0], "index_copy_")
            counts = _counts(rs)
        results.append((counts, all(torch.equal(_bits(a), _bits(b)) for a, b in zip(dst, want))))
    out.put(results)


def _in_interpreter(monkeypatch: pytest.MonkeyPatch, target: Any) -> Any:
    """What ``target(queue)`` puts, run in a child process with Triton's interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = CTX.Queue()
    p = CTX.Process(target=target, args=(q,))
    p.start()
    try:
        return q.get(timeout=240)
    finally:
        p.join(30)


def test_the_triton_kernel_moves_exact_bytes_in_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel CUDA moves take (one launch over all layers), run by Triton's interpreter
    on host tensors: exact bytes, the same operations at 4 and 16 pages."""
    (small, small_ok), (large, large_ok) = _in_interpreter(monkeypatch, _kernel_moves)
    assert small_ok and large_ok
    assert small == large, (small, large)


def _kernel_fails(out: Any) -> None:
    """In a child with TRITON_INTERPRET=1: the warm-up passes; then a kernel that cannot
    be launched (as without a compiler) is turned off, and the move takes the gathers."""
    from vllm_omni_kv.kvcache import page_kernel

    warmed = page_kernel.warm_up(torch.device("cpu"))

    class _Broken:
        def __getitem__(self, grid: Any) -> Any:
            def run(*_a: Any, **_k: Any) -> None:
                raise RuntimeError("ptxas not found")

            return run

    page_kernel._kernel = lambda: _Broken()  # type: ignore[assignment]
    src, dst, pairs = _pages(13)[:2], _pages(14)[:2], _pairs(4, 4)
    want = _expected(src, dst, pairs)
    plan = MovePlan.whole(src, dst, pairs)
    with device_order.installed("cpu", RecordingStreams()) as rs:
        assert isinstance(rs, RecordingStreams)
        move(plan)
        gathered = bool(rs.queued(rs.side_streams()[-1], "index_copy_"))
    exact = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(dst, want))
    out.put((warmed, gathered, exact, page_kernel.usable(plan, torch.device("cpu"))))


def test_a_kernel_that_cannot_launch_is_turned_off_and_the_move_still_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm-up (run where a consumer registers a CUDA cache for ``cuda_ipc``) compiles
    and checks the kernel; a kernel that fails to compile or launch is turned off for the
    process and that move, like every later one, takes the per-layer gathers: exact bytes."""
    warmed, gathered, exact, usable_after = _in_interpreter(monkeypatch, _kernel_fails)
    assert warmed and gathered and exact and not usable_after
