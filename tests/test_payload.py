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
from vllm_omni_kv.transfer import codec


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


def _craft(
    header: dict, data: bytes = b"", *, version: int = codec.VERSION, magic: bytes = codec.MAGIC
) -> bytes:
    """A frame with an arbitrary header and a valid checksum (so table checks are reached)."""
    hb = msgpack.packb(header, use_bin_type=True)
    start = codec.align_up(codec.PRELUDE_SIZE + len(hb))
    body = bytearray(start + len(data))
    body[codec.PRELUDE_SIZE : codec.PRELUDE_SIZE + len(hb)] = hb
    body[start:] = data
    digest = xxhash.xxh3_64_intdigest(bytes(body[codec.PRELUDE_SIZE :]))
    codec.PRELUDE.pack_into(
        body, 0, magic, version, codec.CHECKSUM_XXH3, 0, len(hb), len(data), digest
    )
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
        ({"t": [], "b": [[0, 99]], "v": 1}, b"\0" * 8, "blob #0"),
        (
            {"t": [["float32", [1, 1, 1, 1, 1, 1, 1, 1, 1], 0, 4]], "b": [], "v": 1},
            b"\0" * 4,
            "bad shape",
        ),
    ],
)
def test_table_validation(header, data, match):
    raw = _craft(header, data)
    if match is None:
        assert codec.decode(raw).shape == (2,)
    else:
        with pytest.raises(KVPayloadError, match=match):
            codec.decode(raw)


def test_wrong_magic_version_and_truncation():
    good = bytes(_kv().to_bytes())
    with pytest.raises(KVPayloadError, match="magic"):
        KVCacheTransferData.from_bytes(b"XXXX" + good[4:])
    with pytest.raises(KVPayloadError, match="version"):
        codec.decode(_craft({"t": [], "b": [], "v": 1}, version=99))
    for cut in (0, 10, 31, 40, len(good) - 1):
        with pytest.raises(KVPayloadError, match="truncated"):
            KVCacheTransferData.from_bytes(good[:cut])


def test_checksum_mismatch_anywhere_after_prelude():
    good = bytearray(_kv().to_bytes())
    for pos in (codec.PRELUDE_SIZE, codec.PRELUDE_SIZE + 5, len(good) // 2, len(good) - 1):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        with pytest.raises(KVPayloadError, match="checksum"):
            KVCacheTransferData.from_bytes(bad)


def test_non_kv_object_is_rejected_as_kv_payload():
    with pytest.raises(KVPayloadError, match="lacks field"):
        KVCacheTransferData.from_bytes(codec.encode({"a": 1}).to_bytearray())


def test_header_garbage_with_valid_checksum():
    raw = bytearray(_craft({"t": [], "b": [], "v": 1}))
    raw[codec.PRELUDE_SIZE] = 0xC1  # never-used msgpack byte
    digest = xxhash.xxh3_64_intdigest(bytes(raw[codec.PRELUDE_SIZE :]))
    struct.pack_into("<Q", raw, 20, digest)
    with pytest.raises(KVPayloadError, match="msgpack"):
        codec.decode(raw)


# -- fuzzing ---------------------------------------------------------------------------------

_GOOD = bytes(_kv(seq=5, heads=2, dim=32, layers=2).to_bytes())


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
    # Only the reserved prelude bytes are outside the checksum; anything else must be caught.
    changed = [i for i in range(len(raw)) if raw[i] != _GOOD[i]]
    assert all(codec.PRELUDE.size <= pos < codec.PRELUDE_SIZE for pos in changed)
    ref = KVCacheTransferData.from_bytes(_GOOD)
    assert out["block_ids"] == ref["block_ids"]


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
    # host decoding of an accelerator frame needs an explicit opt-out of the checksum
    host = packed.cpu()
    with pytest.raises(KVPayloadError, match="no checksum"):
        KVCacheTransferData.from_bytes(host.numpy())
    assert KVCacheTransferData.from_bytes(host.numpy(), verify=False)["block_ids"] == src.block_ids
