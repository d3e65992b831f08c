"""Structure-aware fuzzing of frame headers: each case mutates the decoded header (types,
lengths, counts, shapes, dtypes, nesting) or the prelude's sizes, then re-packs the frame
with its digests and checksum recomputed, so the checks past the checksum run. Every case
must either decode (a mutation that leaves a valid frame; its tensors are then read) or
raise KVPayloadError: no other exception, no RecursionError on deep nesting, no
allocation of the sizes a header declares."""

from __future__ import annotations

import copy
import math
import resource
import struct
from typing import Any

import msgpack
import pytest
import torch
from _frame_forge import header_paths, repack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.auth import AuthKey
from vllm_omni_kv.wire.digests import head_digest
from vllm_omni_kv.wire.prelude import CHECKSUM_LINEAR, CHECKSUM_XXH3
from vllm_omni_kv.wire.stream import ArrivedFrameStream

CHUNK = 256
KEY = AuthKey(b"fuzz-key-" + bytes(range(40)))
FAR = 1e18


def _source() -> dict[str, Any]:
    return {
        "request_id": "r-1",
        "layer_blocks": {
            "key_cache": [torch.arange(96, dtype=torch.float32).view(4, 3, 8), None],
            "value_cache": [torch.arange(48, dtype=torch.int16).view(2, 3, 8), None],
        },
        "block_ids": [3, 1, 4],
        "metadata": {"seq_len": 4, "blob": bytes(range(256)) * 5},
    }


BASE = codec.encode(_source(), CHUNK)
BASE_RAW = bytes(BASE.to_bytearray())
BASE_HEADER = msgpack.unpackb(
    BASE.header, raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d)
)
DATA = BASE_RAW[BASE.data_start : BASE.data_start + BASE.data_len]


def _repack(header: Any | bytes, *, data: bytes = DATA, **over: Any) -> bytearray:
    return repack(header, data, CHUNK, **over)


def _check(buf: bytearray) -> None:
    """Decode ``buf`` every way a reader does: only success or KVPayloadError."""
    try:
        out = codec.decode(buf)
    except KVPayloadError:
        pass
    else:
        _touch(out)
    try:
        s = ArrivedFrameStream(buf)
        s.authenticate(None)
        for _ in s.load(None, FAR):
            pass
        _touch(s.obj)
    except KVPayloadError:
        pass


def _touch(obj: Any) -> None:
    """Read every tensor a successful decode returned (its views must be valid)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            o.view(torch.uint8).sum() if o.numel() else None
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


# -- structural mutations -----------------------------------------------------------------
WEIRD = st.sampled_from(
    [
        None,
        True,
        False,
        -1,
        0,
        1,
        63,
        2**31,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        1.5,
        math.nan,
        math.inf,
        "",
        "float32",
        "bfloat16",
        "complex64",
        "nope",
        b"\x00" * 4,
        [],
        {},
        [[]],
        [0, 0, 0, 0],
        ["float32", [1], 0, 4],
        ["float32", [2**40, 2**40], 0, 4],
        ["float32", [0, 2**64 - 1], 0, 0],
        ["float32", [2**48, 2**48, 0], 0, 0],
        ["bfloat16", [0, 2**47, 2**47], 0, 0],
        ["int8", [2**24, 2**24, 2**24, 0], 0, 0],
        ["float32", [-1, 4], 0, 16],
        ["float32", [3], 1, 12],
        ["float32", [8], 0, 32, 5],
        ["int8", [len(DATA) + 1], 0, len(DATA) + 1],
        ["uint8", [1] * 9, 0, 1],
        [2**63, 2**63],
        [0, len(DATA) + 1],
        {"a": {"b": {"c": []}}},
        {1: 2, None: 3, 2.5: "x"},
        msgpack.ExtType(1, b"\xff\xff\xff\xff"),
        msgpack.ExtType(2, b"\x00\x00\x00\x00"),
        msgpack.ExtType(1, b"\x00"),
        msgpack.ExtType(99, b""),
        list(range(300)),
    ]
)


PATHS = header_paths(BASE_HEADER)


def _set(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return tree


@st.composite
def mutated_headers(draw: st.DrawFn) -> Any:
    header = copy.deepcopy(BASE_HEADER)
    for _ in range(draw(st.integers(1, 3))):
        paths = header_paths(header)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "wrap", "append", "dup"]))
        if action == "replace" or not path:
            header = _set(header, path, copy.deepcopy(draw(WEIRD)))
            continue
        parent = header
        for p in path[:-1]:
            parent = parent[p]
        if action == "delete":
            del parent[path[-1]]
        elif action == "wrap":  # one more level of nesting
            parent[path[-1]] = [parent[path[-1]]]
        elif action == "append" and isinstance(parent, list):
            parent.append(copy.deepcopy(draw(WEIRD)))
        elif action == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
    return header


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_headers())
def test_fuzz_structurally_mutated_headers_only_raise_payload_errors(header):
    _check(_repack(header))


@settings(max_examples=300, deadline=None)
@given(
    header=mutated_headers() | st.just(copy.deepcopy(BASE_HEADER)),
    data_len=st.sampled_from([0, 1, 63, len(DATA) - 1, len(DATA) + 1, 2**40, 2**64 - 1]),
    digests=st.sampled_from([None, 0, 1, 2**20, 2**32 - 1]),
    flags=st.sampled_from([0, 1, 2, 0x80]),
)
def test_fuzz_prelude_sizes_against_the_header(header, data_len, digests, flags):
    _check(_repack(header, data_len=data_len, digests=digests, flags=flags))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_headers())
def test_fuzz_mutated_headers_of_device_packed_frames(header):
    """The same with the digests of frames packed on a device (linear, ``checksum_alg`` 2)."""
    _check(_repack(header, alg=CHECKSUM_LINEAR))


@pytest.mark.parametrize("alg", [CHECKSUM_XXH3, CHECKSUM_LINEAR])
@pytest.mark.parametrize(
    "shape", [[2**48, 2**48, 0], [0, 2**48, 2**48], [2**40, 2**9, 0], [2**62, 0], [-1, 0]]
)
def test_dimensions_that_overflow_are_a_payload_error(shape, alg):
    """A zero-byte tensor whose dimensions no allocation can hold: refused while the
    header is read, by every decoder, before any tensor is made."""
    header = copy.deepcopy(BASE_HEADER)
    header["t"][0] = ["float32", shape, 0, 0]
    buf = _repack(header, alg=alg)
    for decode in (
        codec.decode,
        ArrivedFrameStream,
        lambda b: codec.decode_tensor(torch.frombuffer(b, dtype=torch.uint8)),
    ):
        with pytest.raises(KVPayloadError, match="tensor #0"):
            decode(buf)


def test_base_frame_is_valid_and_repacked_identically():
    """The harness itself: the unmutated header re-packs to a frame that decodes right."""
    for alg in (CHECKSUM_XXH3, CHECKSUM_LINEAR):
        buf = _repack(copy.deepcopy(BASE_HEADER), alg=alg)
        assert codec.read_prelude(buf, len(buf)).alg == alg
        out = codec.decode(buf)
        src = _source()
        key = src["layer_blocks"]["key_cache"][0]
        assert torch.equal(out["layer_blocks"]["key_cache"][0], key)
        assert out["metadata"] == src["metadata"]


@pytest.mark.parametrize("depth", [100, 500, 900, 1000, 1024, 2000, 100_000])
@pytest.mark.parametrize("kind", ["list", "map", "mixed"])
def test_deep_nesting_is_a_payload_error_never_recursion(depth, kind):
    step = {"list": b"\x91", "map": b"\x81\xa1k", "mixed": b"\x91\x81\xa1k"}[kind]
    tree = step * depth + b"\xc0"
    body = b"".join(
        [b"\x84", msgpack.packb("t"), b"\x90", msgpack.packb("b"), b"\x90"]
        + [msgpack.packb("c"), msgpack.packb(CHUNK), msgpack.packb("v"), tree]
    )
    buf = _repack(body, data=b"", digests=0)
    with pytest.raises(KVPayloadError, match="nest|msgpack"):
        codec.decode(buf)
    with pytest.raises(KVPayloadError, match="nest|msgpack"):
        ArrivedFrameStream(buf)


def test_deep_nesting_inside_a_table_is_a_payload_error():
    body = b"".join(
        [b"\x84", msgpack.packb("t"), b"\x91" * 5000 + b"\xc0", msgpack.packb("b"), b"\x90"]
        + [msgpack.packb("c"), msgpack.packb(CHUNK), msgpack.packb("v"), b"\xc0"]
    )
    with pytest.raises(KVPayloadError):
        codec.decode(_repack(body, data=b"", digests=0))


def test_keyed_frames_with_mutated_headers_are_refused_by_mac():
    """A keyed frame whose header a forger rewrote (and re-checksummed) fails its MAC."""
    header = copy.deepcopy(BASE_HEADER)
    header["v"]["request_id"] = "r-2"
    keyed = codec.encode(_source(), CHUNK, KEY)
    raw = keyed.to_bytearray()
    p = codec.read_prelude(raw, len(raw))
    hb = msgpack.packb(header, use_bin_type=True)
    assert len(hb) == p.header_len
    raw[codec.PRELUDE_SIZE : codec.PRELUDE_SIZE + len(hb)] = hb
    struct.pack_into("<Q", raw, codec.CHECKSUM_OFFSET, head_digest(memoryview(raw), p))
    assert codec.decode(raw)["request_id"] == "r-2"  # valid xxh3...
    with pytest.raises(KVPayloadError, match="not authenticated"):
        codec.decode(raw, auth=KEY)  # ...refused by the MAC


def test_fuzzing_allocates_nothing_large():
    """Huge declared sizes never turn into allocations: peak RSS grows by far less than
    any of the sizes the cases declare (2**40 and more)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data_len in (2**40, 2**63):
        for shape in ([2**20, 2**20], [0, 2**62], [2**31], [2**48, 2**48, 0]):
            header = copy.deepcopy(BASE_HEADER)
            header["t"][0] = ["float32", shape, 0, 4 * math.prod(shape)]
            _check(_repack(header, data_len=data_len))
            _check(_repack(header))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 * 1024
