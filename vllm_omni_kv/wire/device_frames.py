"""Digests of frames held in device memory, computed where the bytes are.

A frame packed with torch ops (:meth:`~.codec.Frame.to_device_tensor`) carries linear
chunk digests (:mod:`.linear_digest`): :func:`seal` queues every piece sum on the
frame's device, copies them to the host once, and writes the digest trailer and the
prelude checksum into the frame. :func:`verify` checks such a frame in place the same
way; the host checks it chunk by chunk with :func:`~.digests.verify_chunk`.
"""

from __future__ import annotations

import struct
import warnings

import numpy as np
import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire.digests import ChunkMap, check_digest, digest_of_head
from vllm_omni_kv.wire.linear_digest import combine, device_piece_sums
from vllm_omni_kv.wire.prelude import CHECKSUM_OFFSET, DIGEST, DIGEST_SIZE, Prelude, read_prelude


def _digests(frame: torch.Tensor, chunks: ChunkMap) -> list[int]:
    """Every chunk's linear digest of ``frame`` (one copy of the piece sums to the host)."""
    sums = device_piece_sums(frame, chunks.spans(), chunks.chunk_bytes)
    lengths = [e - s for _k, s, e in chunks.iter_bounds(0, chunks.count)]
    return combine(sums.cpu().numpy(), lengths)


def _to_device(dst: torch.Tensor, data: bytes) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only: fine to copy from
        dst.copy_(torch.frombuffer(data, dtype=torch.uint8))


def seal(frame: torch.Tensor, head: bytes | bytearray, chunks: ChunkMap) -> None:
    """Write the digest trailer and prelude checksum of ``frame`` (1-D uint8, data in
    place, bytes ``[0, data_start)`` equal to ``head`` with the checksum field 0)."""
    p = read_prelude(memoryview(head), frame.numel())
    digests = _digests(frame, chunks)
    trailer = struct.pack(f"<{len(digests)}Q", *digests)
    if trailer:
        _to_device(frame[p.trailer_start : p.trailer_start + len(trailer)], trailer)
    checksum = DIGEST.pack(digest_of_head(memoryview(head), trailer))
    _to_device(frame[CHECKSUM_OFFSET : CHECKSUM_OFFSET + DIGEST_SIZE], checksum)


def verify(frame: torch.Tensor, head: bytes, chunks: ChunkMap, p: Prelude) -> None:
    """Check the prelude checksum and every chunk's linear digest of ``frame`` where it
    is (``head``: its bytes ``[0, data_start)``, already on the host)."""
    trailer = frame[p.trailer_start : p.total].cpu().numpy().tobytes()
    expected = DIGEST.unpack_from(head, CHECKSUM_OFFSET)[0]
    got = digest_of_head(memoryview(head), trailer)
    if got != expected:
        raise KVPayloadError(
            f"frame checksum mismatch in its header or digest trailer (expected "
            f"{expected:#018x}, computed {got:#018x}): the payload was corrupted or "
            "overwritten in transit"
        )
    want = np.frombuffer(trailer[: DIGEST_SIZE * chunks.count], dtype="<u8")
    for (k, s, e), have in zip(chunks.iter_bounds(0, chunks.count), _digests(frame, chunks)):
        check_digest(k, s, e, int(want[k]), have)
