"""Frames packed on a device carry linear chunk digests (``checksum_alg`` 2): computed with
torch ops where the frame is (here CPU tensors through the device path, on a GPU in
``make gpu-check``), equal to a reference written here from the format's description
(pure-Python weights, numpy sums), checked by every reader; one flipped byte in any chunk
is caught."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire import codec, linear_digest
from vllm_omni_kv.wire.device_frames import verify as verify_on_device
from vllm_omni_kv.wire.prelude import CHECKSUM_LINEAR
from vllm_omni_kv.wire.stream import ArrivedFrameStream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MASK = (1 << 64) - 1
PIECE = 64 << 10
SEED = int.from_bytes(b"omnikv02", "big")


# -- the reference: the format's description, written out --------------------------------
def _ref_weights() -> np.ndarray:
    out = []
    for j in range(PIECE // 2):  # splitmix64 of j + 1, >> 33, | 1
        z = (SEED + (j + 1) * 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(((z ^ (z >> 31)) >> 33) | 1)
    return np.array(out, dtype=np.int64)


REF_W = _ref_weights()


def _ref_digest(chunk: bytes) -> int:
    sums = []
    for pos in range(0, len(chunk), PIECE):
        piece = chunk[pos : pos + PIECE]
        piece += b"\0" * (len(piece) % 2)
        words = np.frombuffer(piece, dtype="<i2").astype(np.int64)
        sums.append(int((words * REF_W[: words.size]).sum()))
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(sums)}q", *sums))


def _ref_chunks(frame: bytes) -> list[tuple[int, int]]:
    """Chunk bounds from the header's tables: each span cut at the chunk size from its start."""
    info = codec.parse(memoryview(frame), len(frame))
    c, base = info.chunks.chunk_bytes, info.data_start
    spans = sorted([(o, n) for _d, _s, o, n in info.tensors] + list(info.blobs))
    return [(base + o + p, base + o + min(p + c, n)) for o, n in spans for p in range(0, n, c)]


# -- the package against it ---------------------------------------------------------------
def test_weights_are_the_described_table() -> None:
    w = linear_digest.host_weights()
    assert linear_digest.PIECE == PIECE and linear_digest.SEED == SEED
    assert np.array_equal(w, REF_W)
    assert w.min() >= 1 and w.max() < 2**31 and bool((w & 1).all())
    assert torch.equal(linear_digest.weights_on(torch.device("cpu")), torch.from_numpy(REF_W))


SPAN_SETS = [
    [(128, 128 + 300_000)],
    [(64, 64 + 12_345), (12_416, 12_416 + 199_999), (212_480, 400_001)],  # odd ends
    [(3, 3 + 70_001)],  # an odd start: chunks at odd offsets
]


@pytest.mark.parametrize("chunk", [64, 1001, 4096, PIECE, 100_000, 300_000, 1 << 20])
@pytest.mark.parametrize("spans", SPAN_SETS, ids=["one", "odd-ends", "odd-start"])
def test_torch_and_host_digests_equal_the_reference(chunk, spans) -> None:
    g = np.random.default_rng(chunk)
    raw = g.integers(0, 256, 400_001 + 128, dtype=np.uint8)
    frame = torch.from_numpy(raw)
    bounds = [(p, min(p + chunk, e)) for s, e in spans for p in range(s, e, chunk)]
    sums = linear_digest.device_piece_sums(frame, spans, chunk)
    got = linear_digest.combine(sums.numpy(), [e - s for s, e in bounds])
    want = [_ref_digest(raw[s:e].tobytes()) for s, e in bounds]
    assert got == want
    assert [linear_digest.host_digest(raw[s:e]) for s, e in bounds] == want


def test_batched_sums_equal_the_reference(monkeypatch) -> None:
    """Large chunks are summed in batches (whole chunks, or pieces of one chunk)."""
    monkeypatch.setattr(linear_digest, "BATCH", 2 * PIECE)
    raw = np.random.default_rng(5).integers(0, 256, 600_001, dtype=np.uint8)
    frame = torch.from_numpy(raw)
    for chunk in (PIECE + 10, 3 * PIECE + 3, 1 << 19):
        spans = [(0, len(raw))]
        bounds = [(p, min(p + chunk, len(raw))) for p in range(0, len(raw), chunk)]
        sums = linear_digest.device_piece_sums(frame, spans, chunk)
        got = linear_digest.combine(sums.numpy(), [e - s for s, e in bounds])
        assert got == [_ref_digest(raw[s:e].tobytes()) for s, e in bounds], chunk


def _payload() -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "k": [torch.randn(37, 4, 64, generator=g).to(torch.bfloat16) for _ in range(3)],
        "odd": torch.randint(-128, 127, (1001,), generator=g, dtype=torch.int8),
        "blob": bytes(range(256)) * 9,
        "name": "r",
    }


def _device_packed(chunk: int) -> tuple[dict, bytearray]:
    data = _payload()
    packed = codec.encode(data, chunk).to_device_tensor("cpu", on_device=True)
    return data, bytearray(packed.numpy().tobytes())


def _same(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["k"], b["k"], strict=True))
    assert torch.equal(a["odd"], b["odd"]) and a["blob"] == b["blob"] and b["name"] == "r"


@pytest.mark.parametrize("chunk", [64, 4096, 9000, 1 << 20])
def test_a_device_packed_frame_carries_the_reference_digests(chunk) -> None:
    data, raw = _device_packed(chunk)
    p = codec.read_prelude(raw, len(raw))
    assert p.alg == CHECKSUM_LINEAR and not p.keyed
    bounds = _ref_chunks(bytes(raw))
    assert p.digests == len(bounds)
    trailer = struct.unpack_from(f"<{len(bounds)}Q", raw, p.trailer_start)
    assert list(trailer) == [_ref_digest(bytes(raw[s:e])) for s, e in bounds]
    head = bytes(raw[:20]) + bytes(raw[28 : p.data_start]) + bytes(raw[p.trailer_start :])
    assert struct.unpack_from("<Q", raw, 20)[0] == xxhash.xxh3_64_intdigest(head)
    _same(data, codec.decode(raw))
    stream = ArrivedFrameStream(raw)
    stream.authenticate(None)
    for _ in stream.load(None, float("inf")):
        pass
    _same(data, stream.obj)


def _flips(raw: bytearray) -> list[tuple[int, int]]:
    """One byte in every chunk (first, middle, last byte in turn), with its chunk index."""
    bounds = _ref_chunks(bytes(raw))
    return [((s, (s + e) // 2, e - 1)[k % 3], k) for k, (s, e) in enumerate(bounds)]


def test_one_flipped_byte_in_any_chunk_is_caught_by_every_reader() -> None:
    _data, good = _device_packed(4096)
    for pos, k in _flips(good):
        bad = bytearray(good)
        bad[pos] ^= 0x40
        with pytest.raises(KVPayloadError, match=rf"chunk {k} \(.*checksum mismatch"):
            codec.decode(bad)
        tensor = torch.frombuffer(bad, dtype=torch.uint8)
        p = codec.read_prelude(bad, len(bad))
        info = codec.parse(memoryview(bad), len(bad))
        with pytest.raises(KVPayloadError, match=rf"chunk {k} \("):
            verify_on_device(tensor, bytes(bad[: p.data_start]), info.chunks, p)
        with pytest.raises(KVPayloadError, match=rf"chunk {k} \("):
            stream = ArrivedFrameStream(bad)
            stream.authenticate(None)
            for _ in stream.load(None, float("inf")):
                pass


def test_a_changed_digest_or_header_fails_the_prelude_checksum() -> None:
    _data, good = _device_packed(4096)
    p = codec.read_prelude(good, len(good))
    for pos in (p.trailer_start, p.total - 1, 40):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        with pytest.raises(KVPayloadError, match="checksum mismatch"):
            codec.decode(bad)
        info = codec.parse(memoryview(good), len(good))
        tensor = torch.frombuffer(bad, dtype=torch.uint8)
        with pytest.raises(KVPayloadError, match="checksum mismatch"):
            verify_on_device(tensor, bytes(bad[: p.data_start]), info.chunks, p)


def test_device_verification_accepts_the_intact_frame() -> None:
    data, raw = _device_packed(9000)
    p = codec.read_prelude(raw, len(raw))
    info = codec.parse(memoryview(raw), len(raw))
    verify_on_device(
        torch.frombuffer(raw, dtype=torch.uint8), bytes(raw[: p.data_start]), info.chunks, p
    )
    _same(data, codec.decode_tensor(torch.frombuffer(raw, dtype=torch.uint8)))


def test_digest_less_frames_are_refused_unless_the_reader_opts_out() -> None:
    data = _payload()
    frame = codec.encode(data, 4096)
    buf = bytearray(frame.plain_nbytes)
    frame.pack_into(buf, checksum=False)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    for decode in (codec.decode, codec.decode_tensor):
        src = buf if decode is codec.decode else tensor
        with pytest.raises(KVPayloadError, match="no checksum.*require_digests"):
            decode(src)
        _same(data, decode(src, require_digests=False))


@pytest.mark.gpu
@needs_cuda
def test_cuda_packed_frame_is_bit_identical_to_the_cpu_device_path() -> None:
    """Packed on the GPU (digests computed there) and through the same path on CPU
    tensors: the same bytes; verified on the GPU, and a flip there is caught."""
    data = _payload()
    cuda = {**data, "k": [t.cuda() for t in data["k"]], "odd": data["odd"].cuda()}
    for chunk in (4096, 1 << 20):
        on_gpu = codec.encode(cuda, chunk).to_device_tensor()
        on_cpu = codec.encode(data, chunk).to_device_tensor("cpu", on_device=True)
        assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
        got = codec.decode_tensor(on_gpu)
        assert got["k"][0].is_cuda
        _same(data, {**got, "k": [t.cpu() for t in got["k"]], "odd": got["odd"].cpu()})
        pos, k = _flips(bytearray(on_cpu.numpy().tobytes()))[-1]
        on_gpu[pos] ^= 0x40
        with pytest.raises(KVPayloadError, match=rf"chunk {k} \("):
            codec.decode_tensor(on_gpu)
