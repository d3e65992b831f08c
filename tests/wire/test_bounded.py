"""Bounded decoding of frame headers (:mod:`vllm_omni_kv.wire.bounded`): hostile msgpack
(many tiny containers or strings, arrays that declare elements they never supply, huge
tensor tables) is refused before it is decoded; what a parse allocates (tracemalloc)
stays under ``bounded.limit`` of the header's size; a keyed frame's header is decoded only
after its MAC matched; legitimate large headers still decode."""

from __future__ import annotations

import functools
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from _frame_forge import repack

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire import bounded, codec, unpack
from vllm_omni_kv.wire.auth import AuthKey
from vllm_omni_kv.wire.digests import head_digest
from vllm_omni_kv.wire.prelude import CHECKSUM_NONE, CHECKSUM_XXH3, FLAG_MAC, HEAD_MAC_SIZE
from vllm_omni_kv.wire.stream import ArrivedFrameStream, CompleteStream

KEY = AuthKey(b"bounded-key-" + bytes(range(40)))
MIB = 1 << 20


def _array(token: bytes, nbytes: int) -> bytes:
    """A msgpack array of ``token`` repeated to about ``nbytes``."""
    k = nbytes // len(token)
    return b"\xdd" + struct.pack(">I", k) + token * k


def _header(tree: bytes) -> bytes:
    """A frame header (no tensors or blobs) whose tree is the msgpack ``tree``."""
    return b"\x84\xa1t\x90\xa1b\x90\xa1c\xcd\x01\x00\xa1v" + tree


#: msgpack that decodes to far more memory than its size, in ~1 MiB
HOSTILE = {
    "empty lists": _array(b"\x90", MIB),
    "empty maps": _array(b"\x80", MIB),
    "one-entry maps": _array(b"\x81\x00\x00", MIB),
    "non-ASCII 1-char strings": _array(b"\xa2\xc4\x80", MIB),
    "negative fixints": _array(b"\xe0", MIB),
    "nested arrays declaring 16383 elements": b"\xdc\x3f\xff" * 1020 + bytes(MIB),
}


def _peak(fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """Peak bytes allocated while ``fn`` runs, and what it raised."""
    tracemalloc.start()
    try:
        fn()
        err = None
    except Exception as e:
        err = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, err


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_header_is_refused_before_it_is_decoded(name):
    hb = _header(HOSTILE[name])
    frame = bytes(repack(hb, b"", 256))
    peak, err = _peak(lambda: codec.parse(memoryview(frame), len(frame), verify_head=True))
    assert isinstance(err, KVPayloadError), err
    assert "frame header refused" in str(err) and "not a vllm-omni-kv payload" in str(err)
    assert peak < 3 * len(hb) + MIB  # the scan's copies: nothing was decoded
    with pytest.raises(KVPayloadError, match="frame header refused"):
        ArrivedFrameStream(bytearray(frame))


@functools.cache
def _catalogue(nbytes: int) -> dict[str, bytes]:
    """One shape per kind of token: the cost model must cover each."""
    tokens = {
        "list15": b"\x9f" + b"\xc0" * 15,
        "list1": b"\x91\x00",
        "int8": b"\xd0\x80",
        "uint16": b"\xcd\x12\x34",
        "uint64": b"\xcf\xff" + bytes(7),
        "float32": b"\xca\x3f\x80\x00\x01",
        "ascii": b"\xa2ab",
        "3-byte char": b"\xa3\xe2\x82\xac",
        "4-byte char": b"\xa4\xf0\x9f\x98\x80",
        "bin2": b"\xc4\x02ab",
        "fixext1": b"\xd4\x05a",
        "timestamp": b"\xd6\xff\x00\x00\x01\x00",
        "15-entry maps": b"\x8f" + b"".join(bytes([i]) + b"\xc0" for i in range(15)),
    }
    out = {name: _array(t, nbytes) for name, t in tokens.items()}
    out.update({name: _array(t, nbytes) for name, t in (("lists", b"\x90"), ("maps", b"\x80"))})
    k = nbytes // 4
    out["distinct keys"] = (
        b"\xdf"
        + struct.pack(">I", k)
        + b"".join(b"\xa2" + chr(0x100 + i % 1700).encode() + b"\xc0" for i in range(k))
    )
    out["long non-ASCII str"] = msgpack.packb("a" + "\U0001f600" * (nbytes // 4))
    out["nested declared"] = b"\xdc\x3f\xff" * 1000 + bytes(nbytes)
    out["nested fixarrays"] = b"\x9f" * 1023 + b"\x00"
    return out


@pytest.mark.parametrize("name", list(_catalogue(64)))
def test_charge_covers_what_msgpack_allocates(name):
    raw = _catalogue(64 << 10)[name]
    charged = bounded.charge(raw, 1 << 62)
    fast = bounded.FAST_RATE * len(raw) + bounded.DEPTH_SLACK  # small input's worst case
    fast += bounded.SLOT * len(raw) * (raw.count(0xDC) + raw.count(0xDD))
    peak, _err = _peak(
        lambda: msgpack.unpackb(raw, strict_map_key=False, ext_hook=lambda c, d: (c, d))
    )
    assert peak <= charged and peak <= fast, (peak, charged, fast)


def test_header_admitted_near_the_limit_stays_under_it():
    """Cheap and dear tokens mixed so the charge just fits: what parse allocates fits too."""
    n = 2 * MIB
    lists = (bounded.limit(n) - 20 * n) // 74  # empty lists (charge 74), then uint64s
    tree = b"\x92" + _array(b"\x90", lists) + _array(b"\xcf\xff" + bytes(7), n - lists)
    hb = _header(tree)
    assert bounded.charge(hb, 1 << 62) <= bounded.limit(len(hb))
    frame = bytes(repack(hb, b"", 256))
    peak, err = _peak(lambda: codec.parse(memoryview(frame), len(frame), verify_head=True))
    assert err is None and peak <= bounded.limit(len(hb)), (err, peak)


def test_huge_tensor_table_is_refused_within_the_bound():
    entries = 60_000
    hb = msgpack.packb(
        {"t": [["bool", [1], i, 1] for i in range(entries)], "b": [], "v": None, "c": 64}
    )
    frame = bytes(repack(hb, bytes(entries), 64, digests=0, alg=CHECKSUM_NONE))
    peak, err = _peak(lambda: codec.parse(memoryview(frame), len(frame)))
    assert isinstance(err, KVPayloadError) and f"its {entries} tensor and blob" in str(err)
    assert peak <= bounded.limit(len(hb))


def _keyed_forgery(hb: bytes) -> bytearray:
    """A keyed frame around header ``hb`` with a valid checksum and a made-up head MAC."""
    start = codec.align_up(codec.PRELUDE_SIZE + len(hb))
    buf = bytearray(start + HEAD_MAC_SIZE)
    codec.PRELUDE.pack_into(
        buf, 0, codec.MAGIC, codec.VERSION, CHECKSUM_XXH3, FLAG_MAC, len(hb), 0, 0, 0
    )
    buf[codec.PRELUDE_SIZE : codec.PRELUDE_SIZE + len(hb)] = hb
    p = codec.read_prelude(buf, len(buf))
    struct.pack_into("<Q", buf, codec.CHECKSUM_OFFSET, head_digest(memoryview(buf), p))
    return buf


def test_keyed_frame_with_a_forged_header_is_refused_before_decoding(monkeypatch):
    def never(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a header was decoded before its MAC was checked")

    buf = _keyed_forgery(_header(_array(b"\x90", 64 << 10)))
    monkeypatch.setattr(bounded, "unpack_charged", never)
    monkeypatch.setattr(msgpack, "unpackb", never)
    for check in (
        lambda: codec.decode(buf, auth=KEY),
        lambda: unpack.authenticate_frame(buf, KEY),
        lambda: CompleteStream(None, len(buf), buf).authenticate(KEY),
    ):
        with pytest.raises(KVPayloadError, match="frame header is not authenticated"):
            check()


def test_keyed_frames_still_decode_and_parse_once():
    obj = {"request_id": "r", "k": torch.arange(4096.0), "meta": {"n": 1}}
    buf = codec.encode(obj, 4096, KEY).to_bytearray()
    out = codec.decode(buf, auth=KEY)
    assert out["meta"] == {"n": 1} and torch.equal(out["k"], obj["k"])


def test_shared_pages_header_with_page_digests_decodes():
    """The largest legitimate header: per-page digests of 80 layers x 8192 pages."""
    rng = np.random.default_rng(0)
    sums = rng.integers(0, 1 << 63, size=(80, 8192), dtype=np.uint64) << np.uint64(1)
    tree = {
        "metadata": {"format": "shared_pages", "shared": {"sums": sums.tolist()}},
        "block_ids": list(range(8192)),
        "k": torch.ones(4),
    }
    f = codec.encode(tree, 1 << 18)
    assert len(f.header) > 5 * MIB
    assert bounded.charge(f.header, 1 << 62) < bounded.limit(len(f.header))
    out = codec.decode(f.to_bytearray())
    assert out["metadata"]["shared"]["sums"][79][8191] == int(sums[79, 8191])


@pytest.mark.parametrize("tail", [b"\xc1", b"\xdc\x00\x05\x00", b"\xa5ab", b"\xcf\x00"])
def test_malformed_msgpack_is_a_payload_error(tail):
    hb = _header(b"\x92" + _array(b"\x00", 300 << 10) + tail)  # large: the scan reads it
    frame = bytes(repack(hb, b"", 256))
    with pytest.raises(KVPayloadError, match="not valid msgpack"):
        codec.parse(memoryview(frame), len(frame), verify_head=True)
