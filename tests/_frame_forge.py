"""Forging frames as someone who knows the format would: take a frame's header apart,
change it, and re-pack it over the same data bytes with every chunk digest and the
prelude checksum recomputed, so a reader's checks past the checksum are what decide.

Digests are computed over the spans the forged header declares (where they lie inside
the data), in the frame format's chunking: xxh3 (``checksum_alg`` 1, with ``xxhash``) or
the linear digest of frames packed on a device (``checksum_alg`` 2)."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import xxhash

from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.digests import chunk_count, head_digest
from vllm_omni_kv.wire.linear_digest import host_digest
from vllm_omni_kv.wire.prelude import CHECKSUM_LINEAR, CHECKSUM_XXH3


def split(frame: bytes | bytearray) -> tuple[Any, bytes, int]:
    """``(header tree, data bytes, chunk size)`` of an unkeyed frame (extension
    references stay ``msgpack.ExtType``)."""
    p = codec.read_prelude(frame, len(frame))
    hb = bytes(frame[codec.PRELUDE_SIZE : codec.PRELUDE_SIZE + p.header_len])
    header = msgpack.unpackb(
        hb, raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d)
    )
    data = bytes(frame[p.data_start : p.data_start + p.data_len])
    return header, data, int(header["c"])


def declared_spans(header: Any, data_len: int) -> list[tuple[int, int]] | None:
    """The tensor and blob spans ``header`` declares, when all are ints inside the data."""
    try:
        spans = [(int(e[2]), int(e[3])) for e in header["t"]]
        spans += [(int(e[0]), int(e[1])) for e in header["b"]]
    except Exception:
        return None
    if any(off < 0 or nb < 0 or off + nb > data_len for off, nb in spans):
        return None
    return spans


def repack(
    header: Any | bytes,
    data: bytes,
    chunk: int,
    *,
    data_len: int | None = None,
    digests: int | None = None,
    flags: int = 0,
    alg: int = CHECKSUM_XXH3,
) -> bytearray:
    """A frame with ``header`` (an object, or raw msgpack bytes) over ``data``, its digest
    trailer rebuilt for the spans the header declares when they make sense, and a valid
    prelude checksum. ``data_len``, ``digests`` and ``flags`` override what the prelude
    says (a forger may lie there too); ``alg`` picks the digest kind."""
    hb = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    data_start = codec.align_up(codec.PRELUDE_SIZE + len(hb))
    dlen = len(data) if data_len is None else data_len
    spans = declared_spans(header, len(data))
    c = header.get("c") if isinstance(header, dict) else None
    c = c if isinstance(c, int) and not isinstance(c, bool) and c >= 64 else chunk
    n = chunk_count(spans, c) if spans is not None else 0
    n = min(n if digests is None else digests, 1 << 16)
    buf = bytearray(data_start + len(data) + 8 * n)
    codec.PRELUDE.pack_into(buf, 0, codec.MAGIC, codec.VERSION, alg, flags, len(hb), dlen, 0, n)
    buf[codec.PRELUDE_SIZE : codec.PRELUDE_SIZE + len(hb)] = hb
    buf[data_start : data_start + len(data)] = data
    trailer = data_start + len(data)
    if spans is not None:
        k = 0
        for off, nb in sorted(s for s in spans if s[1] > 0):
            for pos in range(0, nb, c):
                if k >= n:
                    break
                a, b = data_start + off + pos, data_start + off + min(pos + c, nb)
                digest = host_digest if alg == CHECKSUM_LINEAR else xxhash.xxh3_64_intdigest
                struct.pack_into("<Q", buf, trailer + 8 * k, digest(bytes(buf[a:b])))
                k += 1
    try:
        p = codec.Prelude(alg, len(hb), dlen, 0, n, flags)
        if p.total <= len(buf):
            struct.pack_into("<Q", buf, codec.CHECKSUM_OFFSET, head_digest(memoryview(buf), p))
    except (ValueError, struct.error):
        pass
    return buf


def header_paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) into a decoded header, the root included."""
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += header_paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += header_paths(v, (*prefix, i))
    return out
