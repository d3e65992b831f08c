"""Chunk digests of a frame: which bytes each digest covers, writing and checking them.

Every data span (tensor or blob) is cut into chunks of the frame's chunk size,
starting at the span's own offset (the last chunk of a span may be shorter).
Chunks are numbered in data-offset order; chunk ``k``'s digest is the u64 at
``trailer_start + 8 * k``: xxh3-64 (``checksum_alg`` 1, frames packed on the host) or
the linear digest of :mod:`.linear_digest` (``checksum_alg`` 2, frames packed on a
device). The prelude's checksum covers the prelude
(less its checksum field), the header with its padding, and the trailer, so a
reader that read the header, the trailer and some chunks verifies exactly the
bytes it read. Padding between spans is covered by nothing and means nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire.linear_digest import host_digest
from vllm_omni_kv.wire.prelude import (
    CHECKSUM_LINEAR,
    CHECKSUM_NONE,
    CHECKSUM_OFFSET,
    CHECKSUM_XXH3,
    DIGEST,
    DIGEST_SIZE,
    TAG_SIZE,
    Prelude,
)

if TYPE_CHECKING:
    from vllm_omni_kv.wire.auth import AuthKey

#: a half-open range ``[start, end)`` of frame bytes
Span = tuple[int, int]
#: a half-open range ``[first, last)`` of chunk indices
Run = tuple[int, int]


class ChunkMap:
    """Where each chunk of a frame lies; built from the data spans and the chunk size.

    ``spans`` are ``(offset, nbytes)`` relative to ``data_start`` (as in the header).
    """

    def __init__(
        self, data_start: int, spans: Sequence[tuple[int, int]], chunk_bytes: int, trailer: int
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.trailer_start = trailer
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._first: list[int] = []
        n = 0
        for off, nbytes in sorted(s for s in spans if s[1] > 0):
            self._starts.append(data_start + off)
            self._ends.append(data_start + off + nbytes)
            self._first.append(n)
            n += -(-nbytes // chunk_bytes)
        self.count = n

    def spans(self) -> list[Span]:
        """The data spans with bytes, as frame bytes ``[start, end)`` in offset order."""
        return list(zip(self._starts, self._ends))

    def bounds(self, k: int) -> Span:
        """Frame bytes ``[start, end)`` of chunk ``k``."""
        i = bisect.bisect_right(self._first, k) - 1
        s = self._starts[i] + (k - self._first[i]) * self.chunk_bytes
        return s, min(s + self.chunk_bytes, self._ends[i])

    def iter_bounds(self, first: int, last: int) -> Iterator[tuple[int, int, int]]:
        """``(k, start, end)`` for chunks ``first <= k < last``."""
        if first >= last:
            return
        c = self.chunk_bytes
        i = bisect.bisect_right(self._first, first) - 1
        k = first
        while k < last:
            span_last = self._first[i + 1] if i + 1 < len(self._first) else self.count
            s = self._starts[i] + (k - self._first[i]) * c
            end = self._ends[i]
            while k < min(last, span_last):
                e = min(s + c, end)
                yield k, s, e
                s = e
                k += 1
            i += 1

    def runs(self, spans: Sequence[Span] | None) -> list[Run]:
        """Sorted, merged chunk runs covering the frame bytes ``spans`` (None: every chunk).

        Bytes outside any data span (prelude, header, padding) need no chunk.
        """
        if spans is None:
            return [(0, self.count)] if self.count else []
        c = self.chunk_bytes
        out: list[Run] = []
        for a, b in spans:
            if b <= a:
                continue
            i = max(0, bisect.bisect_right(self._starts, a) - 1)
            while i < len(self._starts) and self._starts[i] < b:
                s, e = self._starts[i], self._ends[i]
                lo, hi = max(a, s), min(b, e)
                if lo < hi:
                    out.append((self._first[i] + (lo - s) // c, self._first[i] + -(-(hi - s) // c)))
                i += 1
        out.sort()
        merged: list[Run] = []
        for i, j in out:
            if merged and i <= merged[-1][1]:
                if j > merged[-1][1]:
                    merged[-1] = (merged[-1][0], j)
            else:
                merged.append((i, j))
        return merged

    def extent(self, run: Run) -> Span:
        """Frame bytes from the start of ``run``'s first chunk to the end of its last."""
        return self.bounds(run[0])[0], self.bounds(run[1] - 1)[1]

    def byte_ranges(self, runs: Sequence[Run]) -> list[Span]:
        """The frame byte ranges of ``runs``, adjacent ranges merged."""
        out: list[Span] = []
        for run in runs:
            s, e = self.extent(run)
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(e, out[-1][1]))
            else:
                out.append((s, e))
        return out


def chunk_count(spans: Sequence[tuple[int, int]], chunk_bytes: int) -> int:
    """Number of chunks of data spans ``(offset, nbytes)`` at ``chunk_bytes``."""
    return sum(-(-nb // chunk_bytes) for _off, nb in spans if nb > 0)


class ChunkWriter:
    """Packer side: hashes each chunk as its bytes are written and stores its digest.

    ``advance(done)`` is called with increasing write positions inside the current
    span; it returns the end of the last chunk whose digest is in the trailer, so a
    streaming producer advertises only bytes a reader can already verify. With
    ``auth``, each chunk's keyed tag goes to ``tags_start + 16 * k`` as well.
    """

    def __init__(
        self,
        mv: memoryview,
        chunk_bytes: int,
        trailer_start: int,
        auth: AuthKey | None = None,
        tags_start: int = 0,
    ) -> None:
        self._mv = mv
        self._c = chunk_bytes
        self._slot = trailer_start
        self._h = xxhash.xxh3_64()
        self._auth = auth
        self._tag = tags_start
        self._m = auth.chunk_hasher() if auth is not None else None
        self._end = self._cstart = self._hashed = 0

    def span(self, start: int, nbytes: int) -> None:
        """Start a new data span at frame offset ``start``."""
        self._end = start + nbytes
        self._cstart = self._hashed = start

    def advance(self, done: int) -> int:
        mv, c, end = self._mv, self._c, self._end
        hashed, cstart = self._hashed, self._cstart
        done = min(done, end)
        while hashed < done:
            cend = min(cstart + c, end)
            e = cend if done >= cend else done
            auth, m, tag = self._auth, self._m, b""
            if hashed == cstart and e == cend:  # a whole chunk in one go
                digest = xxhash.xxh3_64_intdigest(mv[cstart:cend])
                if auth is not None:
                    tag = auth.chunk_tag(mv[cstart:cend])
            else:
                self._h.update(mv[hashed:e])
                if m is not None:
                    m.update(mv[hashed:e])
                if e < cend:
                    hashed = e
                    break
                digest = self._h.intdigest()
                self._h.reset()
                if auth is not None and m is not None:
                    tag = m.digest()
                    self._m = auth.chunk_hasher()
            if auth is not None:
                mv[self._tag : self._tag + TAG_SIZE] = tag
                self._tag += TAG_SIZE
            DIGEST.pack_into(mv, self._slot, digest)
            self._slot += DIGEST_SIZE
            cstart = hashed = cend
        self._hashed, self._cstart = hashed, cstart
        return cstart


def head_digest(mv: memoryview, p: Prelude) -> int:
    """The prelude checksum: prelude less its checksum field, header + padding, trailer."""
    return digest_of_head(mv[: p.data_start], mv[p.trailer_start : p.total])


def digest_of_head(head: Any, trailer: Any) -> int:
    """The prelude checksum of a frame whose bytes ``[0, data_start)`` are ``head`` and
    whose trailer is ``trailer`` (e.g. both copied off a device)."""
    h = xxhash.xxh3_64()
    h.update(head[:CHECKSUM_OFFSET])
    h.update(head[CHECKSUM_OFFSET + DIGEST_SIZE :])
    h.update(trailer)
    return h.intdigest()


def verify_head(mv: memoryview, p: Prelude) -> None:
    """Check the prelude checksum (read from ``mv`` now) against header and trailer."""
    if p.alg == CHECKSUM_NONE:
        return
    expected = DIGEST.unpack_from(mv, CHECKSUM_OFFSET)[0]
    got = head_digest(mv, p)
    if got != expected:
        raise KVPayloadError(
            f"frame checksum mismatch in its header or digest trailer (expected "
            f"{expected:#018x}, computed {got:#018x}): the payload was corrupted or "
            "overwritten in transit"
        )


def chunk_digest(data: Any, alg: int = CHECKSUM_XXH3) -> int:
    """The digest of one chunk's bytes under checksum algorithm ``alg``."""
    if alg == CHECKSUM_LINEAR:
        return host_digest(data)
    return xxhash.xxh3_64_intdigest(data)


def check_digest(k: int, start: int, end: int, expected: int, got: int) -> None:
    """Raise for chunk ``k`` (frame bytes ``[start, end)``) when ``got != expected``."""
    if got != expected:
        raise KVPayloadError(
            f"chunk {k} (frame bytes [{start}, {end})) checksum mismatch (expected "
            f"{expected:#018x}, computed {got:#018x}): the payload was corrupted or "
            "overwritten in transit"
        )


def verify_chunk(
    mv: memoryview,
    trailer_start: int,
    k: int,
    start: int,
    end: int,
    data: Any = None,
    alg: int = CHECKSUM_XXH3,
) -> None:
    """Check chunk ``k`` (frame bytes ``[start, end)``) against its trailer digest.

    ``data``: where the chunk's bytes are checked (e.g. a copy of them); default the frame.
    ``alg``: the frame's checksum algorithm (its prelude's).
    """
    expected = DIGEST.unpack_from(mv, trailer_start + DIGEST_SIZE * k)[0]
    got = chunk_digest(mv[start:end] if data is None else data, alg)
    check_digest(k, start, end, expected, got)


def verify_chunks(
    mv: memoryview, chunks: ChunkMap, runs: Sequence[Run], alg: int = CHECKSUM_XXH3
) -> int:
    """Check every chunk of ``runs``; return the number of chunk bytes checked."""
    n = 0
    for first, last in runs:
        for k, s, e in chunks.iter_bounds(first, last):
            verify_chunk(mv, chunks.trailer_start, k, s, e, alg=alg)
            n += e - s
    return n
