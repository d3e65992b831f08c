"""The frame's fixed 32-byte prelude and the constants of the frame format (version 2).

See :mod:`vllm_omni_kv.wire.codec` for the whole layout. The prelude alone
gives every region's offset: header ``[32, 32 + header_len)``, data
``[data_start, data_start + data_len)`` with ``data_start = align_up(32 +
header_len, 64)``, then the digest trailer of ``8 * digests`` bytes (xxh3-64 or, for
``checksum_alg`` 2, the linear digest of :mod:`.linear_digest`); a frame with
:data:`FLAG_MAC` (packed with an auth key, see :mod:`.auth`) continues the trailer
with ``16 * digests`` bytes of chunk tags and a 32-byte head MAC.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from vllm_omni_kv.errors import KVPayloadError

MAGIC = b"OMKV"
VERSION = 2
#: magic | u16 version | u8 checksum_alg | u8 flags | u32 header_len | u64 data_len
#: | u64 checksum | u32 digests (number of u64 chunk digests in the trailer)
PRELUDE = struct.Struct("<4sHBBIQQI")
PRELUDE_SIZE = 32
CHECKSUM_OFFSET = 20  # the prelude's checksum field
DIGEST = struct.Struct("<Q")
DIGEST_SIZE = 8
ALIGN = 64
CHECKSUM_NONE = 0
#: chunk digests: xxh3-64 (frames packed on the host)
CHECKSUM_XXH3 = 1
#: chunk digests: the linear digest of :mod:`.linear_digest` (frames packed on a device)
CHECKSUM_LINEAR = 2
#: the checksum algorithms with chunk digests (the prelude checksum is xxh3 for both)
DIGEST_ALGS = (CHECKSUM_XXH3, CHECKSUM_LINEAR)
#: prelude flag: the trailer carries keyed chunk tags and a head MAC (:mod:`.auth`)
FLAG_MAC = 0x01
TAG_SIZE = 16
HEAD_MAC_SIZE = 32
MAX_HEADER = 64 << 20
#: packing copies and hashes this many bytes at a time, so each step is hashed while in cache;
#: also the default chunk size (bytes covered by one digest)
PACK_STEP = 256 << 10
#: smallest and largest chunk size a frame may declare
MIN_CHUNK = 64
MAX_CHUNK = 1 << 31


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Prelude:
    """The decoded prelude of a frame."""

    alg: int
    header_len: int
    data_len: int
    checksum: int
    digests: int
    flags: int = 0

    @property
    def keyed(self) -> bool:
        return bool(self.flags & FLAG_MAC)

    @property
    def data_start(self) -> int:
        return align_up(PRELUDE_SIZE + self.header_len)

    @property
    def trailer_start(self) -> int:
        return self.data_start + self.data_len

    @property
    def tags_start(self) -> int:
        """Where the chunk tags of a keyed frame begin (after the digests)."""
        return self.trailer_start + DIGEST_SIZE * self.digests

    @property
    def head_mac_start(self) -> int:
        return self.tags_start + TAG_SIZE * self.digests

    @property
    def trailer_len(self) -> int:
        macs = TAG_SIZE * self.digests + HEAD_MAC_SIZE if self.keyed else 0
        return DIGEST_SIZE * self.digests + macs

    @property
    def total(self) -> int:
        return self.trailer_start + self.trailer_len


def read_prelude(head: bytes | memoryview, available: int) -> Prelude:
    """Validate the prelude of a frame of ``available`` bytes (``head`` holds at least 32)."""
    if available < PRELUDE_SIZE or len(head) < PRELUDE_SIZE:
        raise KVPayloadError(
            f"truncated frame: {min(available, len(head))} bytes is shorter than the "
            f"{PRELUDE_SIZE}-byte prelude"
        )
    magic, version, alg, flags, header_len, data_len, checksum, digests = PRELUDE.unpack_from(
        head, 0
    )
    if magic != MAGIC:
        raise KVPayloadError(f"not a vllm-omni-kv frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        older = (
            " (written by a vllm-omni-kv release older than chunk digests)" if version == 1 else ""
        )
        raise KVPayloadError(
            f"frame format version {version}{older} is not supported: this build reads "
            f"version {VERSION}; upgrade vllm-omni-kv on both stages to the same release"
        )
    if flags & ~FLAG_MAC:
        raise KVPayloadError(f"frame uses flags {flags:#x} that this build does not understand")
    if alg not in (CHECKSUM_NONE, *DIGEST_ALGS):
        raise KVPayloadError(
            f"unknown checksum algorithm {alg}: the producer runs a newer vllm-omni-kv; "
            "upgrade this stage to the same release"
        )
    if flags & FLAG_MAC and alg != CHECKSUM_XXH3:
        raise KVPayloadError("authenticated frame without chunk digests")
    if alg == CHECKSUM_NONE and digests:
        raise KVPayloadError(f"frame without checksum declares {digests} chunk digests")
    if header_len > MAX_HEADER:
        raise KVPayloadError(f"frame header length {header_len} exceeds the {MAX_HEADER} limit")
    p = Prelude(alg, header_len, data_len, checksum, digests, flags)
    if p.total > available:
        raise KVPayloadError(f"truncated frame: header declares {p.total} bytes, got {available}")
    return p


def parse_prelude(head: bytes | memoryview, available: int) -> tuple[int, int, int, int, int]:
    """``(alg, header_len, data_len, checksum, total)`` of a valid prelude."""
    p = read_prelude(head, available)
    return p.alg, p.header_len, p.data_len, p.checksum, p.total
