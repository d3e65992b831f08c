"""Tests for vllm_omni_kv.kvcache.request_blocks: gather/scatter of one request's KV in paged blocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.kv_utils import normalize_layer_kv
from vllm_omni_kv.kvcache.request_blocks import (
    gather_request_kv,
    request_kv_shape,
    scatter_request_kv,
)

NB, BS, H, D = 6, 4, 2, 8
LAYOUTS = ["flash", "flashinfer", "tuple", "cpu"]
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view, so comparisons are bit-exact and work for fp8."""
    return t.view(_INT[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape) * 4).to(dtype)


def make_cache(
    layout: str, dtype: torch.dtype, nb: int = NB, bs: int = BS, fill: bool = True
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    make: Callable[[tuple[int, ...]], torch.Tensor] = (
        (lambda s: rand(s, dtype)) if fill else (lambda s: torch.zeros(s).to(dtype))
    )
    if layout == "flash":
        return make((2, nb, bs, H, D))
    if layout == "flashinfer":
        return make((nb, 2, bs, H, D))
    if layout == "tuple":
        return make((nb, bs, H, D)), make((nb, bs, H, D))
    return make((nb, H, bs, 2 * D))  # cpu


def ref_slot(raw: object, layout: str, kv: int, block: int, slot: int, head: int) -> torch.Tensor:
    """The [D] vector of token ``slot`` in ``block`` for K (kv=0) / V (kv=1), by explicit indexing."""
    if layout == "flash":
        return raw[kv][block, slot, head]  # type: ignore[index]
    if layout == "flashinfer":
        return raw[block, kv, slot, head]  # type: ignore[index]
    if layout == "tuple":
        return raw[kv][block, slot, head]  # type: ignore[index]
    # cpu: raw [nb, h, bs, 2*D]; per (block, head) memory = K as [D, bs] (transposed),
    # then V as [bs, D] rows
    flat = raw[block, head].reshape(-1)  # type: ignore[index]
    bs = raw.shape[2]  # type: ignore[attr-defined]
    if kv == 0:
        return flat[: D * bs].view(D, bs)[:, slot]
    return flat[D * bs :].view(bs, D)[slot]


def ref_gather(
    raw: object, layout: str, kv: int, ids: list[int], seq_len: int, bs: int
) -> torch.Tensor:
    out = []
    for i in range(seq_len):
        out.append(
            torch.stack([ref_slot(raw, layout, kv, ids[i // bs], i % bs, h) for h in range(H)])
        )
    return torch.stack(out) if out else torch.empty(0, H, D)


def ref_scatter(
    raw: object, layout: str, kv: int, ids: list[int], src: torch.Tensor, bs: int
) -> None:
    for i in range(src.shape[0]):
        for h in range(H):
            dst = ref_slot(raw, layout, kv, ids[i // bs], i % bs, h)
            bits(dst).copy_(bits(src[i, h]))  # dst is a view for every layout


def clone_raw(raw: object) -> object:
    if isinstance(raw, tuple):
        return tuple(t.clone() for t in raw)
    return raw.clone()  # type: ignore[attr-defined]


def raw_same(a: object, b: object) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return same(a, b)  # type: ignore[arg-type]


def views(raw: object, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = normalize_layer_kv(raw, layout=layout)  # type: ignore[arg-type]
    assert out is not None
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seq_len", [0, 3, 8, 10, 13])
def test_gather_matches_reference(layout: str, dtype: torch.dtype, seq_len: int) -> None:
    raw = make_cache(layout, dtype)
    ids = [4, 0, 5, 2]  # non-sequential
    for kv, blocks in enumerate(views(raw, layout)):
        got = gather_request_kv(blocks, ids, seq_len)
        assert got.shape == (seq_len, H, D) and got.is_contiguous()
        want = ref_gather(raw, layout, kv, ids, seq_len, BS).to(dtype)
        assert same(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seq_len", [1, 8, 11])
def test_scatter_writes_exact_slots(layout: str, dtype: torch.dtype, seq_len: int) -> None:
    raw = make_cache(layout, dtype)
    expected = clone_raw(raw)
    ids = [3, 5, 1]
    for kv, blocks in enumerate(views(raw, layout)):
        src = rand((seq_len, H, D), dtype)
        scatter_request_kv(blocks, ids, src)
        ref_scatter(expected, layout, kv, ids, src, BS)
        # gather back is bit-exact
        assert same(gather_request_kv(blocks, ids, seq_len), src)
    # the raw cache changed exactly where the independent reference wrote, nowhere else
    assert raw_same(raw, expected)


def test_scatter_into_cpu_layout_mutates_raw_cache() -> None:
    raw = torch.zeros(NB, H, BS, 2 * D)
    k_blocks, v_blocks = views(raw, "cpu")
    k_src = torch.arange(1, 6 * H * D + 1, dtype=torch.float32).view(6, H, D)
    v_src = -k_src
    scatter_request_kv(k_blocks, [2, 0], k_src)
    scatter_request_kv(v_blocks, [2, 0], v_src)
    # token 5 -> block 0, slot 1; head 1: K column 1 of [D, BS], V row 1 of [BS, D]
    k_part = raw[0, 1].reshape(-1)[: D * BS].view(D, BS)
    v_part = raw[0, 1].reshape(-1)[D * BS :].view(BS, D)
    assert torch.equal(k_part[:, 1], k_src[5, 1])
    assert torch.equal(v_part[1], v_src[5, 1])
    # token 0 -> block 2, slot 0, head 0
    assert torch.equal(raw[2, 0].reshape(-1)[: D * BS].view(D, BS)[:, 0], k_src[0, 0])
    assert torch.equal(raw[2, 0].reshape(-1)[D * BS :].view(BS, D)[0], v_src[0, 0])
    # block 0 slots 2..3 untouched; other blocks untouched
    k0 = raw[0].reshape(H, -1)[:, : D * BS].view(H, D, BS)
    v0 = raw[0].reshape(H, -1)[:, D * BS :].view(H, BS, D)
    assert torch.count_nonzero(k0[:, :, 2:4]) == 0 and torch.count_nonzero(v0[:, 2:4]) == 0
    assert torch.count_nonzero(raw[[1, 3, 4, 5]]) == 0
    # number of written elements = 2 (K, V) * 6 tokens * H * D
    assert torch.count_nonzero(raw) == 2 * 6 * H * D
    # vLLM's kernel view: the K half of each block seen as [D, BS] per head
    k_vllm = raw.view(NB, H, 2, D * BS)[:, :, 0].view(NB, H, D, BS)
    v_vllm = raw.view(NB, H, 2, BS * D)[:, :, 1].view(NB, H, BS, D)
    assert torch.equal(k_vllm[2, :, :, 3], k_src[3])
    assert torch.equal(v_vllm[0, :, 0], v_src[4])


def test_gather_into_caller_buffer() -> None:
    raw = make_cache("cpu", torch.bfloat16)
    k_blocks, _ = views(raw, "cpu")
    seq_len = 7
    arena = torch.zeros(1000, dtype=torch.bfloat16)
    off = 37
    out = arena[off : off + seq_len * H * D].view(seq_len, H, D)
    got = gather_request_kv(k_blocks, torch.tensor([5, 1]), seq_len, out=out)
    assert got is out and got.data_ptr() == arena[off:].data_ptr()
    assert same(
        arena[off : off + seq_len * H * D].view(seq_len, H, D),
        ref_gather(raw, "cpu", 0, [5, 1], seq_len, BS).to(torch.bfloat16),
    )
    assert torch.count_nonzero(arena[:off]) == 0
    assert torch.count_nonzero(arena[off + seq_len * H * D :]) == 0


def test_extra_block_ids_ignored() -> None:
    k_blocks, _ = views(make_cache("flash", torch.float32), "flash")
    a = gather_request_kv(k_blocks, [1, 2], 5)
    b = gather_request_kv(k_blocks, [1, 2, 3, 0], 5)
    assert same(a, b)


def test_request_kv_shape() -> None:
    k_blocks, _ = views(make_cache("cpu", torch.float32), "cpu")
    assert request_kv_shape(k_blocks, 9) == (9, H, D)


def test_gather_errors() -> None:
    k_blocks, _ = views(make_cache("flashinfer", torch.float32), "flashinfer")
    with pytest.raises(KVPayloadError, match="out of range"):
        gather_request_kv(k_blocks, [0, NB], 6)
    with pytest.raises(KVPayloadError, match="out of range"):
        gather_request_kv(k_blocks, [-1], 2)
    with pytest.raises(KVPayloadError, match="needs 3 blocks"):
        gather_request_kv(k_blocks, [0, 1], 9)
    with pytest.raises(KVPayloadError, match="shape"):
        gather_request_kv(k_blocks, [0, 1], 5, out=torch.empty(6, H, D))
    with pytest.raises(KVPayloadError, match="dtype"):
        gather_request_kv(k_blocks, [0, 1], 5, out=torch.empty(5, H, D, dtype=torch.bfloat16))
    with pytest.raises(KVPayloadError, match="contiguous"):
        gather_request_kv(k_blocks, [0, 1], 5, out=torch.empty(H, 5, D).transpose(0, 1))
    with pytest.raises(KVPayloadError, match="seq_len"):
        gather_request_kv(k_blocks, [0], -1)
    with pytest.raises(KVPayloadError):
        gather_request_kv(torch.empty(2, 3, 4), [0], 1)


def test_scatter_errors() -> None:
    k_blocks, _ = views(make_cache("flash", torch.float32), "flash")
    with pytest.raises(KVPayloadError, match="distinct"):
        scatter_request_kv(k_blocks, [1, 1], torch.zeros(6, H, D))
    with pytest.raises(KVPayloadError, match="dtype"):
        scatter_request_kv(k_blocks, [1], torch.zeros(2, H, D, dtype=torch.bfloat16))
    with pytest.raises(KVPayloadError, match="heads"):
        scatter_request_kv(k_blocks, [1], torch.zeros(2, H + 1, D))
    with pytest.raises(KVPayloadError, match="blocks"):
        scatter_request_kv(k_blocks, [1], torch.zeros(5, H, D))


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    bs=st.integers(1, 5),
    seq_len=st.integers(0, 20),
    data=st.data(),
)
def test_roundtrip_property(layout: str, bs: int, seq_len: int, data: st.DataObject) -> None:
    nb = 8
    needed = -(-seq_len // bs)
    if needed > nb:
        seq_len, needed = nb * bs, nb
    ids = data.draw(st.permutations(list(range(nb))))[:needed]
    dtype = data.draw(st.sampled_from(DTYPES))
    raw = make_cache(layout, dtype, nb=nb, bs=bs, fill=False)
    before = clone_raw(raw)
    for kv, blocks in enumerate(views(raw, layout)):
        src = rand((seq_len, H, D), dtype)
        scatter_request_kv(blocks, ids, src)
        ref_scatter(before, layout, kv, ids, src, bs)
        assert same(gather_request_kv(blocks, ids, seq_len), src)
    assert raw_same(raw, before)
