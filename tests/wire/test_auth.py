"""Keyed frames (auth key): round trips, and forged frames with valid xxh3 refused."""

from __future__ import annotations

import ctypes
import os
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, AuthKey, key_from_config, load_key_file
from vllm_omni_kv.wire.digests import head_digest, verify_head
from vllm_omni_kv.wire.stream import ArrivedFrameStream, ChunkedStream, tensor_span

KEY = AuthKey(b"k" * 16 + bytes(range(16)) + b"first-key")
OTHER = AuthKey(b"o" * 16 + bytes(range(16)) + b"other-key")
CHUNK = 4096
FAR = time.monotonic() + 1e6


def _obj() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "request_id": "req-1_a",
        "k": torch.randn(64, 2, 64, generator=g),  # 32 KiB: 8 chunks
        "v": torch.randn(64, 2, 64, generator=g).to(torch.bfloat16),
        "blob": bytes(range(256)) * 8,  # a 2 KiB blob
        "meta": {"seq_len": 64},
    }


def _packed(auth: AuthKey | None = KEY) -> bytearray:
    return codec.encode(_obj(), CHUNK, auth).to_bytearray()


def _fix_checksum(buf: bytearray) -> None:
    """What a forger does: recompute the (unkeyed) prelude checksum."""
    p = codec.read_prelude(buf, len(buf))
    struct.pack_into("<Q", buf, codec.CHECKSUM_OFFSET, head_digest(memoryview(buf), p))


def _fix_chunk_digest(buf: bytearray, k: int) -> None:
    info = codec.parse(memoryview(buf), len(buf))
    s, e = info.chunks.bounds(k)
    struct.pack_into(
        "<Q", buf, info.chunks.trailer_start + 8 * k, xxhash.xxh3_64_intdigest(buf[s:e])
    )


def _load(buf: bytearray, auth: AuthKey | None) -> dict:
    s = ArrivedFrameStream(buf)
    s.authenticate(auth)
    for _ in s.load(None, FAR):
        pass
    return s.obj


def _assert_equal_obj(out: dict) -> None:
    ref = _obj()  # an independent copy of what was packed
    assert out["request_id"] == ref["request_id"] and out["meta"] == ref["meta"]
    assert out["blob"] == ref["blob"]
    assert torch.equal(out["k"], ref["k"]) and torch.equal(out["v"], ref["v"])


def test_keyed_round_trip_decode_stream_and_copy_into():
    buf = _packed()
    p = codec.read_prelude(buf, len(buf))
    assert p.keyed and p.digests == 8 + 4 + 1  # k, v, blob chunks
    assert len(buf) == p.data_start + p.data_len + p.digests * (8 + 16) + 32
    _assert_equal_obj(codec.decode(buf, auth=KEY))
    _assert_equal_obj(_load(buf, KEY))
    # copy_into: the bytes of "k" to a private tensor, each chunk checked in its destination
    s = ArrivedFrameStream(buf)
    s.authenticate(KEY)
    a, b = tensor_span(s, s.obj["k"])
    dst = torch.empty_like(_obj()["k"])
    view = memoryview(
        np.frombuffer((ctypes.c_char * (b - a)).from_address(dst.data_ptr()), np.uint8)
    )
    s.copy_into([(a, b, dst.data_ptr(), view)], FAR)
    assert torch.equal(dst, _obj()["k"])


def test_unkeyed_frames_unchanged_without_a_key():
    buf = _packed(None)
    p = codec.read_prelude(buf, len(buf))
    assert not p.keyed and len(buf) == p.data_start + p.data_len + 8 * p.digests
    _assert_equal_obj(_load(buf, None))


def test_consumer_with_key_refuses_unkeyed_frame():
    buf = _packed(None)
    with pytest.raises(KVPayloadError, match="carries no MAC"):
        _load(buf, KEY)
    with pytest.raises(KVPayloadError, match="carries no MAC"):
        codec.decode(buf, auth=KEY)


def test_consumer_without_key_refuses_keyed_frame():
    with pytest.raises(KVPayloadError, match="producer authenticates its payloads"):
        _load(_packed(), None)
    s = ArrivedFrameStream(_packed())  # never authenticated: load refuses too
    with pytest.raises(KVPayloadError, match="producer authenticates"):
        list(s.load(None, FAR))


def test_mac_stripped_with_valid_checksum_is_refused():
    buf = _packed()
    p = codec.read_prelude(buf, len(buf))
    stripped = bytearray(buf[: p.tags_start])  # drop tags and head MAC, clear the flag
    stripped[7] = 0  # the prelude flags byte
    _fix_checksum(stripped)
    verify_head(memoryview(stripped), codec.read_prelude(stripped, len(stripped)))
    _assert_equal_obj(codec.decode(stripped))  # a valid unkeyed frame...
    with pytest.raises(KVPayloadError, match="not authenticated"):
        _load(stripped, KEY)  # ...that a keyed consumer refuses


def test_wrong_head_mac_with_valid_checksum_is_refused():
    buf = _packed()
    p = codec.read_prelude(buf, len(buf))
    buf[p.head_mac_start : p.head_mac_start + 32] = os.urandom(32)
    _fix_checksum(buf)
    codec.decode(buf)  # xxh3 is satisfied
    with pytest.raises(KVPayloadError, match="frame header is not authenticated"):
        _load(buf, KEY)
    with pytest.raises(KVPayloadError, match="not authenticated"):
        codec.decode(buf, auth=KEY)


def test_frame_of_another_key_is_refused():
    buf = _packed(OTHER)
    codec.decode(buf, auth=OTHER)
    with pytest.raises(KVPayloadError, match="different auth keys"):
        _load(buf, KEY)
    with pytest.raises(KVPayloadError, match="not authenticated"):
        codec.decode(buf, auth=KEY)


@pytest.mark.parametrize("k", [0, 5, 12])  # a chunk of k, of v, the blob
def test_tampered_body_with_recomputed_xxh3_is_refused(k):
    buf = _packed()
    info = codec.parse(memoryview(buf), len(buf))
    s, _e = info.chunks.bounds(k)
    buf[s] ^= 0x5A
    _fix_chunk_digest(buf, k)
    _fix_checksum(buf)
    codec.decode(buf)  # every xxh3 digest and the checksum match
    with pytest.raises(KVPayloadError, match=f"chunk {k} .* not authenticated"):
        _load(buf, KEY)


def test_tampered_header_with_recomputed_xxh3_is_refused():
    buf = _packed()
    at = bytes(buf).index(b"req-1_a")
    buf[at : at + 7] = b"req-9_z"
    _fix_checksum(buf)
    assert codec.decode(buf)["request_id"] == "req-9_z"
    with pytest.raises(KVPayloadError, match="frame header is not authenticated"):
        _load(buf, KEY)


def test_swapped_chunk_tags_are_refused():
    buf = _packed()
    p = codec.read_prelude(buf, len(buf))
    t0, t1 = p.tags_start, p.tags_start + 16
    buf[t0:t1], buf[t1 : t1 + 16] = bytes(buf[t1 : t1 + 16]), bytes(buf[t0:t1])
    _fix_checksum(buf)
    with pytest.raises(KVPayloadError, match="not authenticated"):
        _load(buf, KEY)


def test_partial_load_checks_its_chunks_and_the_head():
    buf = _packed()
    p = codec.read_prelude(buf, len(buf))
    buf[p.head_mac_start] ^= 1
    _fix_checksum(buf)
    s = ArrivedFrameStream(buf)
    s.authenticate(KEY)
    steps = []
    with pytest.raises(KVPayloadError, match="frame header is not authenticated"):
        for o in s.load([tensor_span(s, s.obj["v"])], FAR):
            steps.append(o)
    assert s.size not in steps  # never reported as loaded


class _Arriving(ChunkedStream):
    """A frame whose bytes a producer thread writes while this stream reads it (a
    stand-in for a streaming transport): ``_wait`` blocks until they are written."""

    def __init__(self, buf: bytearray, progress: list[int], cond: threading.Condition) -> None:
        self._buf, self._progress, self._cond = buf, progress, cond
        with cond:
            cond.wait_for(lambda: progress[0] > 0, timeout=10)
        mv = memoryview(buf)
        self.frame_address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        info = codec.parse(mv, len(buf))
        self._start(mv, info, verify=True, deadline=FAR)

    def _wait(self, start, need, end, deadline, cancel):
        with self._cond:
            assert self._cond.wait_for(lambda: self._progress[0] >= need, timeout=10)
            return min(end, self._progress[0])

    def _finish(self, deadline, cancel):
        with self._cond:
            assert self._cond.wait_for(lambda: self._progress[0] >= len(self._buf), timeout=10)
        verify_head(memoryview(self._buf), self._info.prelude)


def _stream_pack(tamper_chunk: int | None) -> tuple[_Arriving, threading.Thread, list[int]]:
    frame = codec.encode(_obj(), CHUNK, KEY)
    buf = bytearray(frame.nbytes)
    progress, cond = [0], threading.Condition()
    tampered: list[int] = []

    def produce() -> None:
        bad = None if tamper_chunk is None else frame.chunks.bounds(tamper_chunk)
        for done in frame.iter_pack(buf):
            if bad is not None and done >= bad[1]:  # the chunk, its digest and tag are written
                buf[bad[0]] ^= 0xFF
                _fix_chunk_digest_live(buf, frame, tamper_chunk)
                tampered.append(done)
                bad = None
            with cond:
                progress[0] = done
                cond.notify_all()
            time.sleep(0.001)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    return _Arriving(buf, progress, cond), t, tampered


def _fix_chunk_digest_live(buf: bytearray, frame: codec.Frame, k: int | None) -> None:
    assert k is not None
    s, e = frame.chunks.bounds(k)
    trailer = frame.data_start + frame.data_len
    struct.pack_into("<Q", buf, trailer + 8 * k, xxhash.xxh3_64_intdigest(buf[s:e]))


def test_streamed_keyed_frame_round_trip():
    s, t, _ = _stream_pack(None)
    s.authenticate(KEY)
    for _ in s.load(None, FAR):
        pass
    t.join(10)
    _assert_equal_obj(s.obj)


def test_streamed_tampering_is_refused_at_its_chunk():
    s, t, tampered = _stream_pack(3)
    s.authenticate(KEY)
    seen = []
    with pytest.raises(KVPayloadError, match="chunk 3 .* not authenticated"):
        for o in s.load(None, FAR):
            seen.append(o)
    t.join(10)
    assert tampered and s.size not in seen


# -- key files ------------------------------------------------------------------------------
def _key_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    f = tmp_path / "omnikv.key"
    f.write_bytes(data)
    f.chmod(mode)
    return f


def test_key_file_loaded_and_equal_keys_agree(tmp_path):
    f = _key_file(tmp_path, b"x" * 40 + b"\n")
    a, b = load_key_file(f), load_key_file(str(f))
    assert a.same_key(b) and str(f) in repr(a) and "xxxx" not in repr(a)
    codec.decode(codec.encode(_obj(), CHUNK, a).to_bytearray(), auth=b)


@pytest.mark.parametrize(
    "data,mode,match",
    [
        (b"short-key", 0o600, "at least 32 bytes"),
        (b"x" * 40, 0o644, "chmod 600"),
        (b"x" * 40, 0o620, "chmod 600"),
        (b"x" * 5000, 0o600, "short secret"),
    ],
)
def test_bad_key_files_refused(tmp_path, data, mode, match):
    with pytest.raises(ConfigError, match=match):
        load_key_file(_key_file(tmp_path, data, mode))


def test_binary_key_is_used_byte_for_byte(tmp_path):
    """Random bytes may begin or end with whitespace bytes: a binary key keeps them (a
    32-byte key stays 32 bytes), while a text key loses its newline."""
    binary = b"\n" + bytes(range(128, 158)) + b" "
    a = load_key_file(_key_file(tmp_path, binary))
    b = load_key_file(_key_file(tmp_path / ".." / tmp_path.name, binary))
    assert a.same_key(b)
    text = tmp_path / "text.key"
    text.write_bytes(b"Zm9v" * 11 + b"\n")
    text.chmod(0o600)
    other = tmp_path / "text2.key"
    other.write_bytes(b"Zm9v" * 11)
    other.chmod(0o600)
    assert load_key_file(text).same_key(load_key_file(other))
    assert not load_key_file(text).same_key(a)


def test_missing_key_file_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_key_file(tmp_path / "nope")


def test_env_var_used_when_not_configured(tmp_path, monkeypatch):
    f = _key_file(tmp_path, b"y" * 32)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    assert key_from_config(None) is None
    monkeypatch.setenv(ENV_KEY_FILE, str(f))
    got = key_from_config(None)
    assert got is not None and got.same_key(AuthKey(b"y" * 32))
    configured = tmp_path / "configured.key"
    configured.write_bytes(b"z" * 32)
    configured.chmod(stat.S_IRUSR)
    got = key_from_config(str(configured))  # the config field wins over the variable
    assert got is not None and got.same_key(AuthKey(b"z" * 32))


def test_complete_stream_of_a_small_frame_is_authenticated():
    """Streams handed over whole (shared-memory inline entries) keep their frame bytes."""
    from vllm_omni_kv.wire.stream import CompleteStream

    for buf, auth, ok in [
        (_packed(), KEY, True),
        (_packed(), OTHER, False),
        (_packed(), None, False),
        (_packed(None), KEY, False),
        (_packed(None), None, True),
    ]:
        s = CompleteStream(codec.decode(buf), len(buf), frame=bytes(buf))
        if ok:
            s.authenticate(auth)
        else:
            with pytest.raises(KVPayloadError):
                s.authenticate(auth)
    with pytest.raises(KVPayloadError, match="cannot be checked"):
        CompleteStream({"x": 1}, 1).authenticate(KEY)  # no frame bytes to check
