"""How side-channel messages travel: msgpack maps in length-prefixed frames over TCP.

A frame is a 4-byte big-endian length, then that many bytes (a msgpack map, or a keyed
envelope of one: :mod:`.envelope`). One connection carries one request at a time: a
client sends a frame and reads the reply frame before it sends the next. A server
refuses a request frame over :data:`MAX_REQUEST` bytes by closing the connection, before
reading it; a client refuses a reply over :data:`MAX_MESSAGE` bytes the same way.
Decoding is bounded (:mod:`vllm_omni_kv.wire.bounded`): a message that could take more
than 4 MiB + 16 bytes per message byte of objects is refused before it is decoded.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.wire import bounded

__all__ = ["LENGTH", "MAX_MESSAGE", "MAX_REQUEST", "frame", "pack", "split_endpoint", "unpack"]

#: largest reply a client accepts
MAX_MESSAGE = 1 << 20
#: largest request a server reads (requests are maps of a few hundred bytes)
MAX_REQUEST = 16 << 10
LENGTH = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix."""
    return LENGTH.pack(len(payload)) + payload


def pack(msg: dict[str, Any]) -> bytes:
    """An unkeyed message's bytes (msgpack)."""
    out: bytes = msgpack.packb(msg, use_bin_type=True)
    return out


def unpack(raw: bytes) -> dict[str, Any]:
    """The map a message's bytes hold (``KVTransferError`` for anything else)."""
    try:
        msg = bounded.unpackb(raw)
    except bounded.UnpackLimitError as e:
        raise KVTransferError(f"side-channel message refused: {e}") from None
    except Exception as e:
        raise KVTransferError(f"side-channel message is not valid msgpack: {e}") from None
    if not isinstance(msg, dict):
        raise KVTransferError(f"side-channel message must be a map, got {type(msg).__name__}")
    return msg


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``("host", port)`` of ``tcp://host:port`` (``[v6]`` brackets allowed)."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 < number < 65536:
        raise KVTransferError(f"side-channel endpoint {endpoint!r} is not tcp://host:port")
    return host.removeprefix("[").removesuffix("]"), number
