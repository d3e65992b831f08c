"""Bounded decoding of what peers and other processes hand a backend: side-channel messages
(:mod:`~vllm_omni_kv.backends.pull.framing`) and shared-memory segment references
(:func:`~vllm_omni_kv.backends.shm.arena.ref_fields`). Hostile msgpack is refused before
it is decoded, within :func:`vllm_omni_kv.wire.bounded.limit` of its size."""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest

from vllm_omni_kv.backends.pull import framing
from vllm_omni_kv.backends.shm import arena, reader
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.wire import bounded


def test_side_channel_reply_of_tiny_containers_is_refused():
    n = framing.MAX_MESSAGE - 16
    raw = b"\x81\xa1k\xdd" + struct.pack(">I", n) + b"\x90" * n
    tracemalloc.start()
    try:
        with pytest.raises(KVTransferError, match="side-channel message refused"):
            framing.unpack(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(raw) + (1 << 20)  # nothing was decoded


def test_side_channel_messages_still_decode():
    msg = {"op": "get", "key": "k" * 100, "spans": [[0, 4096]] * 1000, "blob": b"x" * 4096}
    assert framing.unpack(framing.pack(msg)) == msg
    big = {"ids": list(range(100_000))}  # ~300 KB: decoded after a scan
    assert framing.unpack(framing.pack(big)) == big
    with pytest.raises(KVTransferError, match="not valid msgpack"):
        framing.unpack(b"\xc1")


def test_segment_reference_round_trip():
    ref = {"seg": arena.SEG_PREFIX + "1_x", "gen": 3, "size": 4096, "pid": 7, "pooled": True}
    entry = b"R" + msgpack.packb({**ref, "owner": "abc"})
    got = reader.parse_ref(entry)
    assert got is not None and (got.seg, got.gen, got.size, got.pid) == (
        "omnikv_seg_1_x",
        3,
        4096,
        7,
    )
    assert arena.entry_frame_bytes(entry) == 4096


def test_oversized_segment_reference_is_refused_before_decoding():
    n = arena.MAX_REF_BYTES + 1
    entry = b"S\xdd" + struct.pack(">I", n) + b"\x90" * n
    with pytest.raises(ValueError, match="segment reference of"):
        arena.ref_fields(entry)
    with pytest.raises(KVPayloadError, match="corrupt shared-memory index entry"):
        reader.parse_ref(entry)
    with pytest.raises(ValueError):
        arena.entry_frame_bytes(entry)


def test_segment_reference_decoding_is_bounded():
    entry = b"R" + b"\x9f" * 1023  # as deep as msgpack nests, each level declaring 15 items
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            arena.ref_fields(entry)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= bounded.limit(len(entry))
