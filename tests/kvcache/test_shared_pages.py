"""Shared-pages payloads: layer geometry, rebuilt views, page copies, payload checks.

Caches are vLLM-like (one int8 allocation viewed per layer, as ``allocate_kv_cache``
does, built here by hand and by the layout emulator); expected pages come from
indexing the source views and from digests computed here with xxhash directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.shared_pages import (
    attach_layers,
    copy_pages,
    describe_request,
    layer_geometry,
    page_sums,
    shared_fields,
)
from vllm_omni_kv.testing.layout_emulator import STORAGE, EmulatedEngine, build_caches

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 24, 2, 16, 32
PAIRS = [(5, 9), (6, 10), (7, 11), (12, 0), (2, 1), (3, 20)]  # two runs and jumps
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _ident(layout: str, dtype: torch.dtype, packing: str = "k_v") -> KVLayoutId:
    esize = torch.empty((), dtype=dtype).element_size()
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    return KVLayoutId(packing, layout, name, BS, BS, HEADS, DIM, esize)


def _vllm_like(
    layout: str, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(int8 allocation, per-layer [blocks, heads, bs, 2*dim] views)`` filled with
    random bit patterns; LBNHC views are token-major inside a block."""
    esize = torch.empty((), dtype=dtype).element_size()
    per = BLOCKS * HEADS * BS * 2 * DIM * esize
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (LAYERS * per,), generator=g, dtype=torch.int8)
    views = []
    for i in range(LAYERS):
        flat = buf[i * per : (i + 1) * per].view(dtype)
        if layout == "LBHNC":
            views.append(flat.view(BLOCKS, HEADS, BS, 2 * DIM))
        else:
            views.append(flat.view(BLOCKS, BS, HEADS, 2 * DIM).transpose(1, 2))
    return buf, views


def _raw(view: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind ``view`` as a flat uint8 tensor."""
    st = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


def _same_views(
    got: list[torch.Tensor], want: list[torch.Tensor], g_base: int, w_base: int
) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a.data_ptr() - g_base == b.data_ptr() - w_base
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_geometry_rebuilds_the_layer_views(layout: str, dtype: torch.dtype) -> None:
    buf, views = _vllm_like(layout, dtype, seed=1)
    ident = _ident(layout, dtype)
    per = buf.numel() // LAYERS
    geo = layer_geometry(views, buf.data_ptr(), buf.numel())
    assert geo is not None
    assert [g[0] for g in geo] == [i * per for i in range(LAYERS)]
    # over the same allocation and over a copy of its bytes (another mapping)
    same = attach_layers(buf.view(torch.uint8), geo, ident, dtype)
    _same_views(same, views, buf.data_ptr(), buf.data_ptr())
    copy = buf.view(torch.uint8).clone()
    other = attach_layers(copy, geo, ident, dtype)
    _same_views(other, views, copy.data_ptr(), buf.data_ptr())
    # views reaching outside the named region are no geometry
    assert layer_geometry(views, buf.data_ptr(), buf.numel() - 1) is None
    assert layer_geometry(views, buf.data_ptr() + per, buf.numel() - per) is None


EMULATED = [
    EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC"),
    EmulatedEngine(backend="FLASH_ATTN", layout="BLHNC", dtype="float16"),
    EmulatedEngine(backend="FLASHINFER", layout="LBHNC", kernel_block_size=16),
    EmulatedEngine(backend="FLASHMLA", layout="LBNHC", head_size=64, dtype="fp8_e4m3"),
    EmulatedEngine(backend="CPU_ATTN", layout="LBHNC"),
]


@pytest.mark.parametrize("e", EMULATED, ids=lambda e: f"{e.backend}-{e.layout}-{e.dtype}")
def test_geometry_of_emulated_vllm_caches(e: EmulatedEngine) -> None:
    views = list(build_caches(e).values())
    raw = _raw(views[0])
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    dtype = STORAGE[e.dtype]
    ident = KVLayoutId(
        e.packing, e.layout, e.dtype, e.block_size, e.kernel, e.heads, e.head_size,
        torch.empty((), dtype=dtype).element_size(),
    )  # fmt: skip
    geo = layer_geometry(views, raw.data_ptr(), raw.numel())
    assert geo is not None
    copy = raw.clone()
    _same_views(attach_layers(copy, geo, ident, dtype), views, copy.data_ptr(), raw.data_ptr())
    # pages through the rebuilt views are the source's pages
    src = [page_view(v, ident) for v in attach_layers(copy, geo, ident, dtype)]
    dst_views = [torch.zeros_like(v) for v in views]
    dst = [page_view(v, ident) for v in dst_views]
    pairs = [(7, 1), (2, 5), (3, 6), (9, 0)]
    copy_pages(src, dst, pairs)
    for s, d in zip(views, dst_views, strict=True):  # manager block = `ratio` kernel blocks
        bs, bd = s.unflatten(0, (-1, ident.ratio)), d.unflatten(0, (-1, ident.ratio))
        for a, b in pairs:
            assert torch.equal(_bits(bd[b]), _bits(bs[a]))
        untouched = [i for i in range(bd.shape[0]) if i not in {b for _a, b in pairs}]
        assert not _bits(bd[untouched]).any()


def _hostile(first: list[Any], g0: list[Any], total: int) -> list[Any]:
    """Spoilt geometries; ``g0`` is a layer view ending exactly at the region's end."""
    off, shape, stride = g0
    return [
        [[first[0] + 1, first[1], first[2]]],  # misaligned for a 2-byte dtype
        None,
        {"0": g0},
        "geometry",
        [],
        [None],
        [[off]],
        [["x", shape, stride]],
        [[off, shape, "stride"]],
        [[total, shape, stride]],  # starts at the end
        [[total - 2, shape, stride]],  # runs past the end
        [[-2, shape, stride]],
        [[off, shape[:3], stride[:3]]],
        [[off, [*shape, 1], [*stride, 1]]],
        [[off, [shape[0] + 1, *shape[1:]], stride]],  # one block too many
        [[off, [2**62, *shape[1:]], [0, *stride[1:]]]],  # more elements than int64 counts
        [[off, [2**40, *shape[1:]], stride]],
        [[off, shape, [-stride[0], *stride[1:]]]],
        [[off, shape, [2**40, *stride[1:]]]],
        [[off, [0, *shape[1:]], stride]],
        [[off, [shape[0], shape[2], shape[1], shape[3]], stride]],  # heads/tokens swapped
        [[off, shape, [stride[0], stride[2], stride[1], stride[3]]]],  # wrong page order
        [g0, [total, shape, stride]],  # the second layer is the bad one
    ]


def _inside(views: list[torch.Tensor], region: torch.Tensor) -> bool:
    for v in views:
        start = v.data_ptr() - region.data_ptr()
        span = sum((s - 1) * st for s, st in zip(v.shape, v.stride(), strict=True)) + 1
        end = start + span * v.element_size()
        if start < 0 or end > region.numel() or min(v.stride()) < 0:
            return False
    return True


def test_hostile_geometry_is_refused_and_never_out_of_bounds() -> None:
    buf, views = _vllm_like("LBHNC", torch.bfloat16, seed=2)
    ident = _ident("LBHNC", torch.bfloat16)
    region = buf.view(torch.uint8)
    total = region.numel()
    geo = layer_geometry(views, buf.data_ptr(), total)
    assert geo is not None
    for bad in _hostile(geo[0], geo[-1], total):
        with pytest.raises(KVPayloadError):
            attach_layers(region, bad, ident, torch.bfloat16)
    # random geometry: refused, or every view inside the region
    rnd = random.Random(7)
    accepted = refused = 0
    sizes = [0, 1, 2, 3, BLOCKS, HEADS, BS, 2 * DIM, 2**31, 2**62, -1]
    strides = [0, 1, 2, 2 * DIM, BS * 2 * DIM, HEADS * BS * 2 * DIM, 2**40, 2**63, -1]
    offs = [0, 2, total // 2, total - 2, total, total + 2, -2, 2**63, 1]
    for _ in range(3000):
        shape = (
            [rnd.choice(sizes), HEADS, BS, 2 * DIM]
            if rnd.random() < 0.6
            else [rnd.choice(sizes) for _ in range(4)]
        )
        stride = [rnd.choice(strides) for _ in range(4)]
        if rnd.random() < 0.4:
            stride[1:] = [BS * 2 * DIM, 2 * DIM, 1]
        try:
            got = attach_layers(region, [[rnd.choice(offs), shape, stride]], ident, torch.bfloat16)
        except KVPayloadError:
            refused += 1
            continue
        assert _inside(got, region), (shape, stride)
        accepted += 1
    assert accepted > 50 and refused > 50


def _digest(page: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(_bits(page.contiguous()).numpy().tobytes())


Views = list[torch.Tensor]


def _copy_case(
    layout: str, dtype: torch.dtype, padded: bool = False
) -> tuple[Views, Views, Views, Views]:
    _buf, src = _vllm_like(layout, dtype, seed=3)
    _dbuf, dst = _vllm_like(layout, dtype, seed=4)
    if padded:  # pages that are not one run of memory: the tensor-copy path
        src = [torch.cat([v, v[..., :8]], -1)[..., : 2 * DIM] for v in src]
        dst = [torch.cat([v, v[..., :8]], -1)[..., : 2 * DIM] for v in dst]
    return src, dst, [v.clone() for v in src], [v.clone() for v in dst]


@pytest.mark.parametrize(
    ("layout", "dtype", "padded"),
    [
        ("LBHNC", torch.bfloat16, False),
        ("LBNHC", torch.float32, False),
        ("LBHNC", torch.float32, True),
    ],
    ids=["bf16-HNC", "fp32-NHC", "fp32-strided-pages"],
)
@pytest.mark.parametrize("digests", [False, True])
def test_copy_pages_copies_exactly_the_pairs(
    layout: str, dtype: torch.dtype, padded: bool, digests: bool
) -> None:
    src, dst, src0, dst0 = _copy_case(layout, dtype, padded)
    ident = _ident(layout, dtype)
    sp, dp = [page_view(v, ident) for v in src], [page_view(v, ident) for v in dst]
    sums = None
    if digests:
        sums = [[_digest(p[s]) for s, _d in PAIRS] for p in sp]
        assert page_sums(sp, [s for s, _d in PAIRS]) == sums
    moved = copy_pages(sp, dp, PAIRS, sums)
    page_bytes = HEADS * BS * 2 * DIM * torch.empty((), dtype=dtype).element_size()
    assert moved == LAYERS * len(PAIRS) * page_bytes
    for s, s_before, d, d_before in zip(src, src0, dst, dst0, strict=True):
        want = d_before.clone()
        for a, b in PAIRS:
            want[b] = s_before[a]
        assert torch.equal(_bits(d), _bits(want))
        assert torch.equal(_bits(s), _bits(s_before))


def test_copy_pages_verifies_a_later_slice_of_the_payload() -> None:
    src, dst, src0, _dst0 = _copy_case("LBHNC", torch.bfloat16)
    ident = _ident("LBHNC", torch.bfloat16)
    sp, dp = [page_view(v, ident) for v in src], [page_view(v, ident) for v in dst]
    sums = [[_digest(p[s]) for s, _d in PAIRS] for p in sp]
    copy_pages(sp, dp, PAIRS[3:], sums, first=3)  # pairs[j] is payload page 3 + j
    for d, s in zip(dst, src0, strict=True):
        assert all(torch.equal(_bits(d[b]), _bits(s[a])) for a, b in PAIRS[3:])
    with pytest.raises(KVPayloadError, match="does not match"):
        copy_pages(sp, dp, PAIRS[3:], sums, first=0)  # checked against the wrong digests


@pytest.mark.parametrize("padded", [False, True])
def test_tampered_source_page_fails_its_digest(padded: bool) -> None:
    src, dst, _src0, _dst0 = _copy_case("LBHNC", torch.bfloat16, padded)
    ident = _ident("LBHNC", torch.bfloat16)
    sp, dp = [page_view(v, ident) for v in src], [page_view(v, ident) for v in dst]
    sums = [[_digest(p[s]) for s, _d in PAIRS] for p in sp]
    _bits(src[1][12])[1, 3, 5] ^= 1  # layer 1, source block 12 (payload page 3)
    with pytest.raises(KVPayloadError, match="layer 1 page 3"):
        copy_pages(sp, dp, PAIRS, sums)


@pytest.mark.parametrize("pair", [(BLOCKS, 0), (-1, 0), (0, BLOCKS), (0, -1), (10**9, 0)])
def test_copy_pages_refuses_pages_outside_either_cache(pair: tuple[int, int]) -> None:
    src, dst, _src0, dst0 = _copy_case("LBHNC", torch.bfloat16)
    ident = _ident("LBHNC", torch.bfloat16)
    sp, dp = [page_view(v, ident) for v in src], [page_view(v, ident) for v in dst]
    with pytest.raises(KVPayloadError, match="outside"):
        copy_pages(sp, dp, [(1, 2), pair])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(dst, dst0, strict=True))


def _payload(ids: list[int], num_tokens: int, digests: bool = True) -> dict[str, Any]:
    buf, views = _vllm_like("LBHNC", torch.bfloat16, seed=5)
    geometry = layer_geometry(views, buf.data_ptr(), buf.numel())
    shared = {"region": {"kind": "test"}, "hold": "h", "geometry": geometry}
    data = describe_request(
        "r", ids, num_tokens, views, _ident("LBHNC", torch.bfloat16), shared,
        digests=digests, metadata={"engine": "p"},
    )  # fmt: skip
    wire = KVCacheTransferData.from_bytes(data.to_bytes())
    want = [[_digest(v[b]) for b in ids[: -(-num_tokens // BS)]] for v in views]
    if digests:
        assert wire["metadata"]["shared"]["sums"] == want
    return wire


def test_describe_request_round_trips_through_shared_fields() -> None:
    ids = [7, 3, 11, 0, 23]
    wire = _payload(ids, 3 * BS + 1)  # four blocks of the five
    assert wire["layer_blocks"] == {} and wire["metadata"]["engine"] == "p"
    meta, shared, got = shared_fields(wire)
    assert got == ids[:4] and meta.num_blocks == 4 and meta.num_tokens == 3 * BS + 1
    assert meta.num_layers == LAYERS and meta.kv_layout == _ident("LBHNC", torch.bfloat16)
    assert shared["hold"] == "h" and shared["region"] == {"kind": "test"}
    _meta, shared, _ids = shared_fields(_payload(ids, BS, digests=False))
    assert shared["sums"] is None


@pytest.mark.parametrize(
    ("ids", "tokens"),
    [([BLOCKS], 1), ([0, -1], BS + 1), ([0, 1], 2 * BS + 1), ([3], 0), ([0, BLOCKS + 5], 2 * BS)],
)
def test_describe_request_refuses_blocks_outside_the_cache(ids: list[int], tokens: int) -> None:
    with pytest.raises(KVPayloadError):
        _payload(ids, tokens)


def _bad_ids(w: dict[str, Any]) -> None:
    w["block_ids"] = w["block_ids"] + [1]


def _few_ids(w: dict[str, Any]) -> None:
    w["block_ids"] = w["block_ids"][:-1]


def _neg_id(w: dict[str, Any]) -> None:
    w["block_ids"][0] = -1


def _str_id(w: dict[str, Any]) -> None:
    w["block_ids"][0] = "1"


def _layers(w: dict[str, Any]) -> None:
    w["metadata"]["shared"]["sums"] = w["metadata"]["shared"]["sums"][:-1]


def _short(w: dict[str, Any]) -> None:
    w["metadata"]["shared"]["sums"][1] = w["metadata"]["shared"]["sums"][1][:-1]


def _not_list(w: dict[str, Any]) -> None:
    w["metadata"]["shared"]["sums"] = {"0": []}


def _no_shared(w: dict[str, Any]) -> None:
    w["metadata"]["shared"] = ["region"]


def _no_meta(w: dict[str, Any]) -> None:
    w["metadata"] = None


@pytest.mark.parametrize(
    "spoil",
    [_bad_ids, _few_ids, _neg_id, _str_id, _layers, _short, _not_list, _no_shared, _no_meta],
)
def test_shared_fields_refuses_inconsistent_payloads(spoil: Callable[[Any], None]) -> None:
    wire = _payload([4, 5, 6], 2 * BS + 3)
    shared_fields(wire)  # consistent as made
    spoil(wire)
    with pytest.raises(KVPayloadError):
        shared_fields(wire)
