"""msgpack decoding with a bound on the memory that hostile input can make it allocate.

``msgpack.unpackb`` turns each byte of input into up to ~80 bytes of Python objects (an
empty list or map is one byte), and it allocates an array's item slots when it reads the
array's declared length, so nested arrays that declare many elements and never supply them
cost up to 8 KiB per input byte. :func:`unpackb` first bounds what decoding ``data`` of
``n`` bytes can allocate (:func:`charge`) and refuses input whose bound exceeds
:func:`limit` = ``LIMIT_BASE + LIMIT_RATE * n`` bytes (16 MiB + 16 per byte) with
:class:`UnpackLimitError`, before any object is built.

The bound is a sum of per-token charges that cover what CPython 3.11 allocates (objects,
list slots, dict and intern-table growth, UTF-8 decoding buffers). Input whose worst case
(:data:`FAST_RATE` per byte, plus 8 bytes per byte for each byte that may declare a 16/32-bit
array) fits the limit, up to ~150 KiB, is decoded at once; larger input is tokenized first: a
regular expression takes runs of numbers and other small tokens (charged 8 per byte, plus
an extra for each byte that may start a dearer number), and containers, strings, bins and
extension values are charged one by one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgpack

__all__ = [
    "LIMIT_BASE",
    "LIMIT_RATE",
    "UnpackLimitError",
    "charge",
    "limit",
    "unpack_charged",
    "unpackb",
]

#: a decode may always allocate this many bytes...
LIMIT_BASE = 16 << 20
#: ...plus this many per input byte
LIMIT_RATE = 16
#: at least what :func:`charge` charges per input byte (a 2-byte non-ASCII str: 94)
FAST_RATE = 112
#: open containers at the end of truncated input: msgpack's 1024 levels of 15-slot lists
DEPTH_SLACK = 1024 * 184
#: charges (CPython 3.11, measured with tracemalloc): a list object and one slot; a dict
#: of 0, 1-5, 6-10, 11-15 entries, and per entry of a larger one (at a resize, when old
#: and new tables coexist); an ASCII str, another str (its UTF-8 decoding buffers take up
#: to 6 bytes per input byte), a str's share of the intern table (map keys are interned);
#: a bytes object; an extension value (ExtType, Timestamp or a hook's result)
LIST, SLOT = 64, 8
DICTS, ENTRY = (72, 224, 224, 224, 224, 224, 352, 352, 352, 352, 352, 640, 640, 640, 640, 640), 96
ASCII, STR, INTERN, BIN, EXT = 56, 192, 96, 64, 128
#: a run of cheap tokens: per byte, plus extra for bytes that may start a 32-byte int
RUN_RATE = 8
#: the scan's own memory besides 2 bytes per input byte (the strings it remembers)
SCAN = 128 << 10

_RUN = re.compile(
    rb"(?:[\xcb\xcf\xd3].{8}"  # float64, uint64, int64 (first: page digests)
    rb"|[\x00-\x7f\xa0\xc0\xc2\xc3\xe0-\xff]"  # fixint, "", nil, false, true, -fixint
    rb"|[\xa1\xcc\xd0]."  # 1-char str, uint8, int8
    rb"|\xc4(?:\x00|\x01.)"  # bin of 0 or 1 bytes
    rb"|[\xcd\xd1].."
    rb"|[\xca\xce\xd2].{4})*+",
    re.DOTALL,
)
# per byte of a run: 1 = uint16/int16 (3 bytes, charge 32), 2 = int8 (2 bytes, 32),
# 3 = negative fixint below -5 (1 byte, 32); counted over every byte of the run (an
# over-count: payload bytes too)
_EXTRA = bytes(
    1 if b in (0xCD, 0xD1) else 2 if b == 0xD0 else 3 if 0xE0 <= b <= 0xFA else 0
    for b in range(256)
)
_NO_EXTRA = bytes(b for b in range(256) if not _EXTRA[b])
_NOT_WIDE = bytes(b for b in range(256) if b not in (0xDC, 0xDD))
#: type byte -> (kind, width of its length field); kinds: s str, b bin, e ext, a array, m map
_SIZED = {
    0xD9: ("s", 1), 0xDA: ("s", 2), 0xDB: ("s", 4),
    0xC4: ("b", 1), 0xC5: ("b", 2), 0xC6: ("b", 4),
    0xC7: ("e", 1), 0xC8: ("e", 2), 0xC9: ("e", 4),
    0xDC: ("a", 2), 0xDD: ("a", 4), 0xDE: ("m", 2), 0xDF: ("m", 4),
}  # fmt: skip
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


class UnpackLimitError(ValueError):
    """Input whose decoding could allocate more than :func:`limit` of its size."""


def limit(n: int) -> int:
    """The most bytes decoding ``n`` bytes of msgpack may allocate."""
    return LIMIT_BASE + LIMIT_RATE * n


class _Tokens:
    """Charges the tokens of ``raw`` that the run pattern does not take, one at a time."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        #: short str payloads charged their intern-table share (a repeat is not charged)
        self.seen: set[bytes] = set()

    def string(self, start: int, size: int) -> int:
        """The charge of a str whose UTF-8 is ``raw[start:start + size]`` (0, 1 byte: cached)."""
        if size < 2:
            return 0
        text = self.raw[start : start + size]
        own = ASCII + size if text.isascii() else STR + 6 * size
        if text in self.seen:
            return own
        if size <= 64 and len(self.seen) < 1024:
            self.seen.add(text)
        return own + INTERN

    def cost(self, kind: str, start: int, size: int) -> tuple[int, int]:
        """``(payload bytes, charge)`` of a token of ``kind`` whose length field says
        ``size`` (its payload starts at ``start``)."""
        if kind == "a":
            return 0, LIST + SLOT * size
        if kind == "m":
            return 0, DICTS[size] if size < len(DICTS) else DICTS[-1] + ENTRY * size
        if kind == "s":
            return size, self.string(start, size)
        if kind == "b":
            return size, BIN + size
        return size + 1, EXT + 2 * size  # ext: a type byte, then the data

    def token(self, pos: int) -> tuple[int, int]:
        """``(end, charge)`` of the token at ``pos``."""
        raw, b = self.raw, self.raw[pos]
        if 0x80 <= b <= 0x9F:  # fixmap, fixarray
            end, (_, c) = pos + 1, self.cost("m" if b < 0x90 else "a", pos, b & 0x0F)
        elif 0xA0 <= b <= 0xBF:  # fixstr
            end, c = pos + 1 + (b & 0x1F), self.string(pos + 1, b & 0x1F)
        elif b in _FIXEXT:
            end, c = pos + 2 + _FIXEXT[b], EXT + 2 * _FIXEXT[b]
        elif b in _SIZED:
            kind, width = _SIZED[b]
            head = pos + 1 + width
            if head > len(raw):
                raise ValueError(f"truncated msgpack at byte {pos}")
            size = int.from_bytes(raw[pos + 1 : head], "big")
            if size > len(raw) - head:  # every element or payload byte needs an input byte
                raise ValueError(f"msgpack at byte {pos} declares {size} items past its end")
            payload, c = self.cost(kind, head, size)
            end = head + payload
        elif b == 0xC1:
            raise ValueError(f"invalid msgpack type byte 0xc1 at byte {pos}")
        else:
            end, c = len(raw) + 1, 0  # a number cut short
        if end > len(raw):
            raise ValueError(f"truncated msgpack at byte {pos}")
        return end, c


def charge(raw: bytes, cap: int) -> int:
    """An upper bound of the bytes ``msgpack.unpackb(raw)`` allocates (its objects and
    their transient buffers, this scan's 2 bytes per byte included); raises
    :class:`UnpackLimitError` as soon as it passes ``cap`` and ``ValueError`` for
    input that is not msgpack."""
    n, pos, total = len(raw), 0, SCAN + 2 * len(raw)
    run, tokens = _RUN.match, _Tokens(raw)
    while pos < n:
        m = run(raw, pos)  # always matches (maybe nothing)
        end = m.end() if m else pos
        if end > pos:
            t = raw[pos:end].translate(_EXTRA, _NO_EXTRA)
            total += RUN_RATE * (end - pos) + 8 * t.count(1) + 16 * t.count(2) + 24 * t.count(3)
            pos = end
            if pos == n:
                break
        pos, c = tokens.token(pos)
        total += c
        if total > cap:
            break
    if total > cap:
        raise UnpackLimitError(
            f"{n} bytes of msgpack could decode into more than {cap} bytes of objects "
            f"(the limit is {LIMIT_BASE} + {LIMIT_RATE} per byte): many tiny containers "
            "or strings"
        )
    return total


def unpack_charged(
    data: bytes | memoryview,
    *,
    ext_hook: Callable[[int, bytes], Any] | None = None,
    strict_map_key: bool = False,
) -> tuple[Any, int]:
    """``(msgpack.unpackb(data, raw=False), the charge it was admitted under)``: small
    input is admitted under its worst case (:data:`FAST_RATE` per byte, and 8 bytes per
    byte for each byte that may declare a 16/32-bit array), other input under
    :func:`charge`; either is at most :func:`limit` of its size."""
    n = len(data) if isinstance(data, bytes) else data.nbytes
    cap = limit(n)
    charged = FAST_RATE * n + DEPTH_SLACK + SLOT * n * n  # as if every byte declared one
    if charged > cap:
        data = bytes(data)
        wide = len(data.translate(None, _NOT_WIDE))  # bytes that may declare a 16/32-bit array
        charged = FAST_RATE * n + DEPTH_SLACK + SLOT * n * wide
        if charged > cap:
            charged = charge(data, cap)
    if ext_hook is None:
        return msgpack.unpackb(data, raw=False, strict_map_key=strict_map_key), charged
    obj = msgpack.unpackb(data, raw=False, strict_map_key=strict_map_key, ext_hook=ext_hook)
    return obj, charged


def unpackb(
    data: bytes | memoryview,
    *,
    ext_hook: Callable[[int, bytes], Any] | None = None,
    strict_map_key: bool = False,
) -> Any:
    """``msgpack.unpackb(data, raw=False)`` once its charge is within :func:`limit`."""
    return unpack_charged(data, ext_hook=ext_hook, strict_map_key=strict_map_key)[0]
