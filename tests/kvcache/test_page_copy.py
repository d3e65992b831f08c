"""Native page copies (``kvcache/_pagecopy.c``) and their Python fallback.

Expected bytes come from torch indexing of the source pages (``want[d] = src[s]``),
never from the copy under test. Both stores are covered (plain and streaming), pages
contiguous and strided, destinations at every alignment the head/tail code handles.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from vllm_omni_kv import KVPayloadError
from vllm_omni_kv.kvcache import page_copy
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.page_copy import STREAM_MIN_BYTES, copy_runs, native_copy, pack_runs
from vllm_omni_kv.kvcache.shared_pages import copy_pages, page_runs

IMPLS = ["native", "python"]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(page_copy, "_native", None)
    return str(request.param)


def test_the_package_was_built_with_its_native_copy() -> None:
    # make env installs the package, which compiles the extension; on x86-64 it streams
    got = native_copy()
    assert got is not None, "vllm_omni_kv.kvcache._pagecopy was not built (pip install -e .)"
    assert "streaming" in got or "memcpy" in got


def _pages(
    n: int, per: int, stride: int, offset: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(backing uint8 buffer, [n, per] page view at byte offset, page stride)``."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (offset + n * stride,), generator=g, dtype=torch.uint8)
    return buf, buf[offset:].as_strided((n, per), (stride, 1))


def _runs(pairs: list[tuple[int, int]]) -> Any:
    return pack_runs([(s, d, n) for _i, s, d, n in page_runs(pairs)])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("per", "pad", "offset"),
    [(4096, 0, 0), (4096, 0, 3), (131072, 0, 40), (1000, 24, 1), (8192, 512, 64), (200, 0, 5)],
)
def test_copy_runs_matches_indexing(
    impl: str, stream: bool, per: int, pad: int, offset: int
) -> None:
    n_src, n_dst = 40, 33
    stride = per + pad
    sbuf, src = _pages(n_src, per, stride, offset, seed=1)
    dbuf, dst = _pages(n_dst, per, stride, (offset * 7) % 64, seed=2)
    rng = random.Random(per + pad + offset)
    pairs = list(zip(rng.sample(range(n_src), 20), rng.sample(range(n_dst), 20), strict=True))
    pairs += [(30, 25), (31, 26), (32, 27)]  # a run of three (one copy when dense)
    src0, want = src.clone(), dst.clone()
    for s, d in pairs:
        want[d] = src0[s]
    before = dbuf.clone()
    moved = copy_runs(
        (dst.data_ptr(), stride, n_dst), (src.data_ptr(), stride, n_src), per, _runs(pairs), stream
    )
    assert moved == len(pairs) * per
    assert torch.equal(dst, want)
    assert torch.equal(src, src0)
    gaps = torch.ones_like(dbuf, dtype=torch.bool)  # bytes outside the pages are untouched
    gaps[(offset * 7) % 64 :].as_strided((n_dst, per), (stride, 1)).fill_(False)
    assert torch.equal(dbuf[gaps], before[gaps])


@pytest.mark.parametrize(
    "run",
    [
        (40, 0, 1),
        (0, 33, 1),
        (39, 0, 2),
        (0, 32, 2),
        (-1, 0, 1),
        (0, -1, 1),
        (0, 0, -1),
        (2**40, 0, 1),
    ],
)
def test_copy_runs_refuses_runs_outside_either_cache_before_copying(
    impl: str, run: tuple[int, int, int]
) -> None:
    _sbuf, src = _pages(40, 256, 256, 0, seed=1)
    _dbuf, dst = _pages(33, 256, 256, 0, seed=2)
    dst0 = dst.clone()
    with pytest.raises(KVPayloadError, match="outside|refused"):
        copy_runs(
            (dst.data_ptr(), 256, 33),
            (src.data_ptr(), 256, 40),
            256,
            pack_runs([(1, 2, 1), run]),
            True,
        )
    assert torch.equal(dst, dst0)  # the valid first run was not copied either


@pytest.mark.parametrize(
    ("d_stride", "s_stride", "per"), [(100, 256, 256), (256, 100, 256), (256, 256, 0)]
)
def test_copy_runs_refuses_overlapping_or_empty_pages(
    impl: str, d_stride: int, s_stride: int, per: int
) -> None:
    _b, t = _pages(4, 256, 256, 0, seed=1)
    with pytest.raises(KVPayloadError, match="refused"):
        copy_runs(
            (t.data_ptr(), d_stride, 4),
            (t.data_ptr(), s_stride, 4),
            per,
            pack_runs([(0, 1, 1)]),
            False,
        )


def test_large_shared_pages_copy_streams_and_matches_indexing() -> None:
    """copy_pages over vLLM-like layer views, big enough for streaming stores."""
    layers, blocks, heads, bs, dim = 4, 48, 4, 32, 64  # 64 KiB pages (bf16)
    ident = KVLayoutId("k_v", "LBHNC", "bfloat16", bs, bs, heads, dim, 2)
    g = torch.Generator().manual_seed(3)
    src = [
        torch.randn(blocks, heads, bs, 2 * dim, generator=g).to(torch.bfloat16)
        for _ in range(layers)
    ]
    dst = [torch.zeros(blocks, heads, bs, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
    rng = random.Random(4)
    pairs = list(zip(rng.sample(range(blocks), 40), rng.sample(range(blocks), 40), strict=True))
    page = heads * bs * 2 * dim * 2
    assert len(pairs) * page * layers >= STREAM_MIN_BYTES  # the streaming path
    moved = copy_pages(
        [page_view(v, ident) for v in src], [page_view(v, ident) for v in dst], pairs
    )
    assert moved == len(pairs) * page * layers
    for s, d in zip(src, dst, strict=True):
        want = torch.zeros_like(d)
        for a, b in pairs:
            want[b] = s[a]
        assert torch.equal(d.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(native_copy() is None, reason="native copy not built")
def test_native_copy_releases_the_gil() -> None:
    """Another Python thread keeps running while a large copy is in C."""
    n, per = 256, 1 << 20
    src, dst = torch.ones(n * per, dtype=torch.uint8), torch.zeros(n * per, dtype=torch.uint8)
    ticks: list[float] = []
    copying = threading.Event()

    def spin() -> None:
        copying.wait(5)
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            ticks.append(time.monotonic())

    t = threading.Thread(target=spin)
    t.start()
    runs = pack_runs(
        [(i, n - 1 - i, 1) for i in range(n)] * 4
    )  # ~1 GiB of copies, each page 4 times
    copying.set()
    t0 = time.monotonic()
    copy_runs((dst.data_ptr(), per, n), (src.data_ptr(), per, n), per, runs, True)
    t1 = time.monotonic()
    t.join()
    assert torch.equal(dst, src)
    during = [x for x in ticks if t0 < x < t1]
    assert t1 - t0 > 0.02 and len(during) > 100, (t1 - t0, len(during))
