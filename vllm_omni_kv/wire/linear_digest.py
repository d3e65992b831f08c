"""The linear chunk digest (``checksum_alg`` 2): what frames packed on a device carry.

A chunk is cut into pieces of :data:`PIECE` bytes from its start (the last may be
shorter). A piece's bytes, a zero byte appended when their count is odd, are read as
little-endian int16 words ``x_j``; the piece's sum is ``sum_j x_j * W[j]`` in int64,
exact (``|x_j| <= 2**15``, ``1 <= W[j] < 2**31``, ``j < 2**15``: ``|sum| < 2**61``).
``W`` is a fixed table of :data:`WORDS` weights: splitmix64 of ``j + 1`` with seed
:data:`SEED`, shifted right by 33 bits, ORed with 1. The chunk's digest is the xxh3-64
of its piece sums (int64, little endian, in order).

The sums are torch ops (widen, multiply, sum) that give the same integers on any
device, so a frame packed on a GPU gets them there, with one small copy of the sums
to the host at the end; :func:`host_digest` computes the same with numpy. Changing
one word changes its piece's sum (every weight is odd and nonzero): this detects
corruption, not forgery (keyed frames carry MACs, see :mod:`.auth`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from vllm_omni_kv.errors import KVPayloadError

#: bytes of one piece (one weighted sum)
PIECE = 64 << 10
WORDS = PIECE // 2
SEED = 0x6F6D6E696B763032  # "omnikv02"
#: data bytes whose widened words one batch of torch ops holds (bounds the temporaries)
BATCH = 16 << 20

_MASK = (1 << 64) - 1
_lock = threading.Lock()
_host: np.ndarray | None = None
_devices: dict[str, torch.Tensor] = {}


def _splitmix64(n: int, seed: int) -> np.ndarray:
    """splitmix64 outputs for ``seed + k * golden``, ``k = 1..n`` (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = z + np.uint64(seed & _MASK)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def host_weights() -> np.ndarray:
    """The weight table ``W`` (int64, :data:`WORDS` entries in ``[1, 2**31)``)."""
    global _host
    if _host is None:
        w = (_splitmix64(WORDS, SEED) >> np.uint64(33)) | np.uint64(1)
        _host = w.astype(np.int64)
        _host.flags.writeable = False
    return _host


def weights_on(device: torch.device) -> torch.Tensor:
    """``W`` as an int64 tensor on ``device`` (made once per device)."""
    key = str(device)
    w = _devices.get(key)
    if w is None:
        with _lock:
            w = _devices.get(key)
            if w is None:
                w = torch.from_numpy(host_weights().copy()).to(device)
                _devices[key] = w
    return w


# -- on the host ---------------------------------------------------------------------------
def _host_piece_sums(b: np.ndarray) -> np.ndarray:
    w = host_weights()
    q, r = divmod(b.size, PIECE)
    out = np.empty(q + (r > 0), dtype=np.int64)
    if q:
        words = b[: q * PIECE].view("<i2").reshape(q, WORDS)
        out[:q] = np.einsum("ij,j->i", words, w, dtype=np.int64, casting="unsafe")
    if r:
        tail = np.zeros(r + (r & 1), dtype=np.uint8)
        tail[:r] = b[q * PIECE :]
        out[q] = np.dot(tail.view("<i2").astype(np.int64), w[: tail.size // 2])
    return out


def host_digest(data: Any) -> int:
    """The digest of one chunk's bytes (anything with the buffer protocol)."""
    b = np.frombuffer(data, dtype=np.uint8)
    return xxhash.xxh3_64_intdigest(_host_piece_sums(b).astype("<i8").tobytes())


# -- with torch ops, on the frame's device --------------------------------------------------
def _word_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Piece sums of ``x`` (uint8, ``[..., L]``, ``L <= PIECE``, last dim contiguous)."""
    n = x.shape[-1]
    even = n % 2 == 0 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1])
    if even:
        words = x.view(torch.int16).to(torch.int64)
        return words.mul_(w[: n // 2]).sum(-1)
    lo = x[..., 0::2].to(torch.int64)  # low bytes (unsigned), then high bytes (signed)
    hi = x[..., 1::2].view(torch.int8).to(torch.int64)
    return lo.mul_(w[: lo.shape[-1]]).sum(-1) + hi.mul_(w[: hi.shape[-1]] * 256).sum(-1)


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _batched(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`_word_sums` of ``x`` (uint8 ``[R, q, L]``) in batches of about :data:`BATCH`
    bytes: whole rows, or the pieces of one row."""
    nrows, q, length = x.shape
    if q * length <= BATCH:
        step = max(1, BATCH // (q * length))
        return _cat([_word_sums(x[i : i + step], w) for i in range(0, nrows, step)])
    step = max(1, BATCH // length)
    rows = [
        _cat([_word_sums(x[i : i + 1, j : j + step], w) for j in range(0, q, step)], dim=1)
        for i in range(nrows)
    ]
    return _cat(rows)


def _row_sums(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Piece sums of each row (one chunk) of ``rows`` (uint8 ``[R, L]``): ``[R, pieces]``."""
    q, r = divmod(rows.shape[1], PIECE)
    parts = []
    if q:
        parts.append(_batched(rows[:, : q * PIECE].unflatten(1, (q, PIECE)), w))
    if r:
        parts.append(_batched(rows[:, q * PIECE :].unsqueeze(1), w))
    return _cat(parts, dim=1)


def device_piece_sums(
    frame: torch.Tensor, spans: Sequence[tuple[int, int]], chunk_bytes: int
) -> torch.Tensor:
    """Every piece sum of the chunks of ``spans`` (frame bytes ``[start, end)``, in offset
    order) of ``frame`` (1-D uint8), chunk by chunk, on the frame's device; queued only."""
    w = weights_on(frame.device)
    out = []
    for start, end in spans:
        n = end - start
        full, tail = divmod(n, chunk_bytes)
        if full:
            rows = frame[start : start + full * chunk_bytes].view(full, chunk_bytes)
            out.append(_row_sums(rows, w).flatten())
        if tail:
            out.append(_row_sums(frame[end - tail : end].view(1, tail), w).flatten())
    if not out:
        return torch.empty(0, dtype=torch.int64, device=frame.device)
    return _cat(out)


def pieces_of(nbytes: int) -> int:
    """Pieces of a chunk of ``nbytes``."""
    return -(-nbytes // PIECE)


def combine(sums: np.ndarray, chunk_lengths: Sequence[int]) -> list[int]:
    """Chunk digests from all piece sums (int64, in order) of chunks of ``chunk_lengths``."""
    raw = sums.astype("<i8").tobytes()
    out, pos = [], 0
    for n in chunk_lengths:
        k = pieces_of(n)
        out.append(xxhash.xxh3_64_intdigest(raw[8 * pos : 8 * (pos + k)]))
        pos += k
    if 8 * pos != len(raw):
        raise KVPayloadError(f"{len(raw) // 8} piece sums for chunks of {pos} pieces")
    return out
