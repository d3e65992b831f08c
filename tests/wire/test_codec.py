"""The packed frame format and KVCacheTransferData: round trips, zero-copy, rejections, fuzzing."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.wire import codec


def _kv(seq: int = 37, heads: int = 4, dim: int = 64, layers: int = 3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seq * 31 + layers)
    keys = [torch.randn(seq, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    vals = [torch.randn(seq, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    keys[1] = None  # a layer that is not transferred
    vals[1] = None
    return KVCacheTransferData(
        "req-1_a",
        {"key_cache": keys, "value_cache": vals},
        [4, 9, 2],
        {"seq_len": seq, "x": [1, "a"]},
    )


def _assert_same(a: KVCacheTransferData, d: dict) -> None:
    assert d["request_id"] == a.request_id
    assert d["block_ids"] == a.block_ids
    assert d["metadata"] == a.metadata
    for name in ("key_cache", "value_cache"):
        for x, y in zip(a.layer_blocks[name], d["layer_blocks"][name], strict=True):
            if x is None:
                assert y is None
            else:
                assert y.dtype == x.dtype and y.shape == x.shape
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_all_dtypes(dtype):
    src = (
        torch.randn(33, 2, 32).to(dtype)
        if dtype.is_floating_point
        else torch.randint(0, 100, (33, 2, 32)).to(dtype)
    )
    data = KVCacheTransferData("r", {"key_cache": [src], "value_cache": [src]}, [1], {})
    _assert_same(data, KVCacheTransferData.from_bytes(bytes(data.to_bytes())))


def test_from_bytes_returns_zero_copy_views():
    data = _kv()
    raw = data.to_bytes()
    out = KVCacheTransferData.from_bytes(raw)
    k0 = out["layer_blocks"]["key_cache"][0]
    base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    assert base <= k0.data_ptr() < base + len(raw)
    assert k0.data_ptr() % codec.ALIGN == (base + (k0.data_ptr() - base)) % codec.ALIGN
    assert (k0.data_ptr() - base) % codec.ALIGN == 0
    raw[k0.data_ptr() - base] ^= 0xFF  # mutate the buffer: the view sees it
    assert not torch.equal(k0, data.layer_blocks["key_cache"][0])


def test_device_tensor_alias_round_trip():
    data = _kv()
    t = data.to_gpu_tensor()
    assert t.dtype == torch.uint8 and t.dim() == 1
    _assert_same(data, KVCacheTransferData.from_bytes_gpu(t))
    _assert_same(data, KVCacheTransferData.from_bytes_device(data.to_device_tensor("cpu")))


def test_lazy_tensor_fills_in_place():
    src = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    lazy = codec.LazyTensor((4, 2, 3), torch.float32, lambda dst: dst.copy_(src * 2))
    out = codec.decode(codec.encode({"t": lazy}).to_bytearray())
    assert torch.equal(out["t"], src * 2)


def test_objects_bytes_and_nesting():
    obj = {
        "a": [1, 2.5, None, True, "s"],
        "small": b"xy",
        "big": b"z" * 5000,
        3: {"t": torch.ones(2)},
    }
    out = codec.decode(codec.encode(obj).to_bytearray())
    assert out["a"] == obj["a"] and out["small"] == b"xy" and out["big"] == obj["big"]
    assert torch.equal(out[3]["t"], torch.ones(2))


def test_unserializable_type_is_rejected():
    with pytest.raises(KVPayloadError, match="cannot serialize"):
        codec.encode({"x": object()})


def test_unsupported_dtype_is_rejected_on_encode():
    with pytest.raises(KVPayloadError, match="not supported"):
        codec.encode({"x": torch.zeros(2, dtype=torch.complex64)}).to_bytearray()


# -- rejections of malformed frames ----------------------------------------------------------


def _ref_chunks(header: dict, data_start: int, chunk: int) -> list[tuple[int, int]]:
    """Reference chunking: each span cut from its own offset, spans in offset order."""
    spans = []
    for entry in list(header.get("t") or []) + list(header.get("b") or []):
        if isinstance(entry, list) and len(entry) in (2, 4):
            off, nb = entry[-2], entry[-1]
            if isinstance(off, int) and isinstance(nb, int) and nb > 0:
                spans.append((off, nb))
    out = []
    for off, nb in sorted(spans):
        for j in range(0, nb, chunk):
            out.append((data_start + off + j, data_start + off + min(j + chunk, nb)))
    return out


def _craft(
    header: dict,
    data: bytes = b"",
    *,
    version: int = codec.VERSION,
    magic: bytes = codec.MAGIC,
    digests: int | None = None,
) -> bytes:
    """A v2 frame with an arbitrary header, its chunk digests and a valid checksum, built
    from the format description (so table checks are reached)."""
    header = {"c": 256 << 10, **header}
    hb = msgpack.packb(header, use_bin_type=True)
    start = (32 + len(hb) + 63) // 64 * 64
    body = bytearray(start + len(data))
    body[32 : 32 + len(hb)] = hb
    body[start:] = data
    c = header["c"]
    chunk = c if isinstance(c, int) and not isinstance(c, bool) and c >= 64 else 1 << 30
    chunks = [(a, min(b, len(body))) for a, b in _ref_chunks(header, start, chunk)]
    trailer = b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body[a:b]))) for a, b in chunks
    )
    n = len(chunks) if digests is None else digests
    trailer += bytes(8 * max(0, n - len(chunks)))
    struct.pack_into("<4sHBBIQQI", body, 0, magic, version, 1, 0, len(hb), len(data), 0, n)
    body += trailer
    digest = xxhash.xxh3_64_intdigest(bytes(body[:20]) + bytes(body[28:start]) + trailer)
    struct.pack_into("<Q", body, 20, digest)
    return bytes(body)


def _ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(codec.EXT_TENSOR, struct.pack("<I", i))


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"t": [["float32", [2], 0, 8]], "b": [], "v": _ref(0)}, b"\0" * 8, None),  # valid control
        (
            {"t": [["complex64", [2], 0, 16]], "b": [], "v": _ref(0)},
            b"\0" * 16,
            "unsupported dtype",
        ),
        ({"t": [["float32", [-2], 0, 8]], "b": [], "v": _ref(0)}, b"\0" * 8, "bad shape"),
        ({"t": [["float32", [3], 0, 8]], "b": [], "v": _ref(0)}, b"\0" * 8, "needs 12 bytes"),
        ({"t": [["float32", [4], 0, 16]], "b": [], "v": _ref(0)}, b"\0" * 8, "out of the"),
        ({"t": [["float32", [2], 2, 8]], "b": [], "v": _ref(0)}, b"\0" * 16, "not aligned"),
        (
            {
                "t": [["float32", [4], 0, 16], ["float32", [4], 8, 16]],
                "b": [],
                "v": [_ref(0), _ref(1)],
            },
            b"\0" * 32,
            "overlapping",
        ),
        ({"t": [], "b": [], "v": _ref(3)}, b"", "missing entry"),
        ({"t": "nope", "b": [], "v": 1}, b"", "tensor table"),
        ({"b": [], "v": 1}, b"", "lacks"),
        ({"t": [], "b": [], "v": 1, "c": 0}, b"", "chunk size"),
        ({"t": [], "b": [], "v": 1, "c": 63}, b"", "chunk size"),
        ({"t": [], "b": [], "v": 1, "c": "4096"}, b"", "chunk size"),
        ({"t": [], "b": [], "v": 1, "c": True}, b"", "chunk size"),
        ({"t": [], "b": [], "v": 1, "c": 1 << 40}, b"", "chunk size"),
        ({"t": [], "b": [], "v": 1, "c": None}, b"", "chunk size"),
        ({"t": [], "b": [[0, 99]], "v": 1}, b"\0" * 8, "blob #0"),
        (
            {"t": [["float32", [1, 1, 1, 1, 1, 1, 1, 1, 1], 0, 4]], "b": [], "v": 1},
            b"\0" * 4,
            "bad shape",
        ),
        # zero bytes, but dimensions whose product overflows what torch can allocate
        ({"t": [["float32", [2**48, 2**48, 0], 0, 0]], "b": [], "v": _ref(0)}, b"", "spans"),
        ({"t": [["uint8", [0, 2**48, 2**48], 0, 0]], "b": [], "v": _ref(0)}, b"", "spans"),
        ({"t": [["int64", [2**46, 0], 0, 0]], "b": [], "v": _ref(0)}, b"", "spans"),
        ({"t": [["float32", [2**40, 2**40], 0, 4]], "b": [], "v": _ref(0)}, b"\0" * 4, "spans"),
        ({"t": [["float32", [2**49, 0], 0, 0]], "b": [], "v": _ref(0)}, b"", "bad shape"),
    ],
)
def test_table_validation(header, data, match):
    raw = _craft(header, data)
    if match is None:
        assert codec.decode(raw).shape == (2,)
    else:
        with pytest.raises(KVPayloadError, match=match):
            codec.decode(raw)


def test_empty_tensors_of_any_allocatable_shape_decode():
    """The limit on dimensions counts an empty dimension as 1: every shape under it is one
    torch allocates (the boundary of the cases refused above)."""
    for shape in ([2**45, 0], [0, 2**20, 2**25], [2**44, 0, 1]):
        header = {"t": [["float64", shape, 0, 0]], "b": [], "v": _ref(0)}
        assert codec.decode(_craft(header, b"")).shape == tuple(shape)


def test_wrong_magic_version_and_truncation():
    good = bytes(_kv().to_bytes())
    with pytest.raises(KVPayloadError, match="magic"):
        KVCacheTransferData.from_bytes(b"XXXX" + good[4:])
    with pytest.raises(KVPayloadError, match="version"):
        codec.decode(_craft({"t": [], "b": [], "v": 1}, version=99))
    for cut in (0, 10, 31, 40, len(good) - 1):
        with pytest.raises(KVPayloadError, match="truncated"):
            KVCacheTransferData.from_bytes(good[:cut])


def test_version_1_frame_is_rejected_with_an_upgrade_hint():
    v1 = bytearray(32)  # a v1 prelude: same magic, version 1
    struct.pack_into("<4sHBBIQQ", v1, 0, b"OMKV", 1, 1, 0, 0, 0, 0)
    with pytest.raises(KVPayloadError, match=r"version 1 .*older.*upgrade vllm-omni-kv"):
        codec.decode(bytes(v1))


def test_trailer_truncation_and_digest_count_are_checked():
    t = torch.arange(3000, dtype=torch.float32)
    raw = bytes(codec.encode({"t": t}, chunk_bytes=1024).to_bytearray())
    n = -(-t.numel() * 4 // 1024)
    assert struct.unpack_from("<I", raw, 28)[0] == n
    for cut in (len(raw) - 8 * n, len(raw) - 1):  # data complete, trailer missing or cut
        with pytest.raises(KVPayloadError, match="truncated"):
            codec.decode(raw[:cut])
    header = {"t": [["float32", [16], 0, 64]], "b": [], "v": _ref(0), "c": 64}
    assert codec.decode(_craft(header, b"\0" * 64)).shape == (16,)
    with pytest.raises(KVPayloadError, match="2 chunk digests but its spans make 1"):
        codec.decode(_craft(header, b"\0" * 64, digests=2))


def test_layout_matches_the_format_description():
    """Prelude fields, trailer position and every digest, computed independently."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(777, generator=g)  # 3108 bytes: 4 chunks of 1000 (the last one short)
    b = torch.randint(0, 255, (2000,), dtype=torch.uint8, generator=g)
    blob = bytes(range(256)) * 5
    raw = bytes(codec.encode({"a": a, "b": b, "z": blob}, chunk_bytes=1000).to_bytearray())
    magic, version, alg, flags, hlen, dlen, _ck, ndig = struct.unpack_from("<4sHBBIQQI", raw)
    assert (magic, version, alg, flags) == (b"OMKV", 2, 1, 0)
    start = (32 + hlen + 63) // 64 * 64
    header = msgpack.unpackb(raw[32 : 32 + hlen], strict_map_key=False)
    assert header["c"] == 1000
    sources = [a.numpy().tobytes(), b.numpy().tobytes(), blob]
    offsets = [e[2] for e in header["t"]] + [e[0] for e in header["b"]]
    digests = []
    for src, off in zip(sources, offsets, strict=True):
        assert raw[start + off : start + off + len(src)] == src
        digests += [xxhash.xxh3_64_intdigest(src[j : j + 1000]) for j in range(0, len(src), 1000)]
    assert ndig == len(digests) == 4 + 2 + 2
    trailer = raw[start + dlen :]
    assert len(trailer) == 8 * ndig and list(struct.unpack(f"<{ndig}Q", trailer)) == digests
    assert struct.unpack_from("<Q", raw, 20)[0] == xxhash.xxh3_64_intdigest(
        raw[:20] + raw[28:start] + trailer
    )


def test_checksum_mismatch_in_header_data_or_trailer():
    frame = _kv().frame(chunk_bytes=512)
    good = bytearray(frame.to_bytearray())
    first = frame.data_start + frame.tensor_table[0][2]
    cases = [
        (codec.PRELUDE_SIZE, "header or digest trailer"),
        (12, "header or digest trailer|truncated|out of the"),  # data_len
        (first, "chunk 0 "),
        (first + 512 * 3 + 7, "chunk 3 "),
        (len(good) - 1, "header or digest trailer"),
    ]
    for pos, match in cases:
        bad = bytearray(good)
        bad[pos] ^= 0x01
        with pytest.raises(KVPayloadError, match=match):
            KVCacheTransferData.from_bytes(bad)


def test_frames_without_checksum_carry_no_digests():
    t = torch.randn(5000)
    f = codec.encode({"t": t}, chunk_bytes=4096)
    buf = bytearray(f.nbytes)
    assert f.pack_into(buf, checksum=False) == f.plain_nbytes < f.nbytes
    with pytest.raises(KVPayloadError, match="no checksum"):
        codec.decode(buf[: f.plain_nbytes])
    assert torch.equal(codec.decode(buf[: f.plain_nbytes], verify=False)["t"], t)
    assert torch.equal(codec.decode_tensor(f.to_device_tensor("cpu"))["t"], t)


@pytest.mark.parametrize("chunk", [64, 1000, 4096, 300_000, 1 << 20])
def test_round_trip_at_any_chunk_size(chunk):
    t = torch.randn(70_000)
    frame = codec.encode({"t": t, "e": torch.empty(0)}, chunk_bytes=chunk)
    out = codec.decode(frame.to_bytearray())
    assert torch.equal(out["t"], t) and out["e"].numel() == 0


def test_bad_chunk_size_on_encode():
    for bad in (0, 63, 1 << 40):
        with pytest.raises(KVPayloadError, match="chunk_bytes"):
            codec.encode({"t": torch.ones(2)}, chunk_bytes=bad)


def test_streamed_packing_writes_each_digest_before_advancing():
    """At every value iter_pack yields, each chunk below it verifies against its slot."""
    n, chunk = 300_000, 4096
    src = torch.arange(n, dtype=torch.int64).to(torch.uint8)

    def fill(dst: torch.Tensor):
        for pos in range(0, n, 10_000):  # odd steps: chunk boundaries fall inside them
            dst[pos : pos + 10_000].copy_(src[pos : pos + 10_000])
            yield min(pos + 10_000, n)

    f = codec.encode({"t": codec.LazyTensor((n,), torch.uint8, fill)}, chunk_bytes=chunk)
    buf = bytearray(f.nbytes)
    start = f.data_start + f.tensor_table[0][2]
    trailer = f.data_start + f.data_len
    seen = []
    for ready in f.iter_pack(buf):
        seen.append(ready)
        if ready >= f.nbytes:
            break
        for k, a in enumerate(range(start, start + n, chunk)):
            b = min(a + chunk, start + n)
            if b <= ready:
                slot = struct.unpack_from("<Q", buf, trailer + 8 * k)[0]
                assert slot == xxhash.xxh3_64_intdigest(bytes(buf[a:b])), (k, ready)
    assert seen == sorted(seen) and seen[-1] == f.nbytes and len(seen) > 10
    assert torch.equal(codec.decode(buf)["t"], src)


def test_chunk_runs_and_ranges_match_a_brute_force_reference():
    sizes = {"a": 10_000, "b": 333, "c": 5000}
    f = codec.encode({k: torch.zeros(n, dtype=torch.uint8) for k, n in sizes.items()}, 1024)
    cm = f.chunks
    bounds = []  # reference: each span cut from its own offset
    for _d, _s, off, nb in f.tensor_table:
        a = f.data_start + off
        bounds += [(a + j, a + min(j + 1024, nb)) for j in range(0, nb, 1024)]
    assert [cm.bounds(k) for k in range(cm.count)] == bounds
    assert [(s, e) for _k, s, e in cm.iter_bounds(0, cm.count)] == bounds
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        pts = sorted(torch.randint(0, f.nbytes, (4,), generator=g).tolist())
        spans = [(pts[0], pts[1]), (pts[2], pts[3])]
        want = {k for k, (s, e) in enumerate(bounds) for a, b in spans if s < b and a < e}
        runs = cm.runs(spans)
        assert {k for i, j in runs for k in range(i, j)} == want
        assert all(r1[1] < r2[0] for r1, r2 in zip(runs, runs[1:]))  # merged, disjoint
        ranges = cm.byte_ranges(runs)
        for k in want:  # every needed chunk lies inside one range
            assert any(a <= bounds[k][0] and bounds[k][1] <= b for a, b in ranges)
    assert cm.runs(None) == [(0, cm.count)]


def test_verifying_a_tail_ignores_corruption_elsewhere():
    from vllm_omni_kv.wire.digests import verify_chunks, verify_head

    t = torch.randn(100_000)  # 400,000 bytes: 49 chunks of 8192 (the last one short)
    f = codec.encode({"t": t}, chunk_bytes=8192)
    raw = bytearray(f.to_bytearray())
    start = f.data_start + f.tensor_table[0][2]
    end = start + 400_000
    raw[start + 10] ^= 0xFF  # chunk 0 is corrupt
    mv = memoryview(raw)
    info = codec.parse(mv, len(raw), verify_head=True)
    tail = info.chunks.runs([(end - 10_000, end)])
    assert tail == [(47, 49)]
    assert verify_chunks(mv, info.chunks, tail) == 400_000 - 47 * 8192
    with pytest.raises(KVPayloadError, match="chunk 0 "):
        verify_chunks(mv, info.chunks, info.chunks.runs([(start, start + 1)]))
    verify_head(mv, info.prelude)


def test_non_kv_object_is_rejected_as_kv_payload():
    with pytest.raises(KVPayloadError, match="lacks field"):
        KVCacheTransferData.from_bytes(codec.encode({"a": 1}).to_bytearray())


def test_header_garbage_with_valid_checksum():
    raw = bytearray(_craft({"t": [], "b": [], "v": 1}))
    raw[codec.PRELUDE_SIZE] = 0xC1  # never-used msgpack byte
    digest = xxhash.xxh3_64_intdigest(bytes(raw[:20]) + bytes(raw[28:]))  # no data, no trailer
    struct.pack_into("<Q", raw, 20, digest)
    with pytest.raises(KVPayloadError, match="msgpack"):
        codec.decode(raw)


# -- fuzzing ---------------------------------------------------------------------------------

_GOOD_FRAME = _kv(seq=5, heads=2, dim=32, layers=2).frame(chunk_bytes=128)
_GOOD = bytes(_GOOD_FRAME.to_bytearray())
#: the data region, and the bytes of it that lie in a span (the rest is padding)
_DATA = (_GOOD_FRAME.data_start, _GOOD_FRAME.data_start + _GOOD_FRAME.data_len)
_COVERED = {
    _GOOD_FRAME.data_start + off + i
    for _d, _s, off, nb in _GOOD_FRAME.tensor_table
    for i in range(nb)
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_payload_errors(blob):
    with pytest.raises(KVPayloadError):
        KVCacheTransferData.from_bytes(blob)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(_GOOD) - 1), st.integers(1, 255)), min_size=1, max_size=4)
)
def test_fuzz_mutated_frames_never_decode_wrong_data(flips):
    raw = bytearray(_GOOD)
    for pos, x in flips:
        raw[pos] ^= x
    try:
        out = KVCacheTransferData.from_bytes(raw)
    except KVPayloadError:
        return
    # Only padding between data spans is covered by no digest; anything else must be caught.
    changed = [i for i in range(len(raw)) if raw[i] != _GOOD[i]]
    assert all(_DATA[0] <= pos < _DATA[1] and pos not in _COVERED for pos in changed)
    ref = KVCacheTransferData.from_bytes(_GOOD)
    assert out["block_ids"] == ref["block_ids"]
    for name in ("key_cache", "value_cache"):
        for x, y in zip(out["layer_blocks"][name], ref["layer_blocks"][name], strict=True):
            assert (x is None and y is None) or torch.equal(
                x.view(torch.uint8), y.view(torch.uint8)
            )


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.floats(allow_nan=False),
            st.text(),
            st.binary(max_size=3000),
            st.none(),
        ),
        max_size=6,
    )
)
def test_fuzz_plain_objects_round_trip(obj):
    assert codec.decode(codec.encode(obj).to_bytearray()) == obj


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)"
)
def test_device_frame_stays_on_the_accelerator():
    src = _kv()
    cuda = KVCacheTransferData(
        src.request_id,
        {
            n: [t.cuda() if t is not None else None for t in ls]
            for n, ls in src.layer_blocks.items()
        },
        src.block_ids,
        src.metadata,
    )
    packed = cuda.to_gpu_tensor()
    assert packed.is_cuda and packed.dtype == torch.uint8
    out = KVCacheTransferData.from_bytes_gpu(packed)
    k0 = out["layer_blocks"]["key_cache"][0]
    assert k0.is_cuda and k0.data_ptr() >= packed.data_ptr()  # a view, no copy
    assert torch.equal(k0.cpu(), src.layer_blocks["key_cache"][0])
    # an accelerator frame carries linear digests: the host checks them too
    host = packed.cpu()
    assert codec.read_prelude(host.numpy(), host.numel()).alg == 2
    assert KVCacheTransferData.from_bytes(host.numpy())["block_ids"] == src.block_ids
