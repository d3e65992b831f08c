"""The keyed side-channel envelope: a small MAC-checked header before the message body.

A keyed message (request or reply) is::

    header (78 bytes)  version 1 | ts <f8 | nonce 16 | boot 16 | body length <u4 | body digest 32
    MAC (32 bytes)     keyed BLAKE2b of the header (request and reply keys differ)
    body               msgpack map

The MAC covers the header only; the header names the body by its length and its
(unkeyed) BLAKE2b-256 digest. A receiver checks the MAC over 78 bytes before it looks
at the body, so a message made without the key costs a hash of its header, whatever its
size; the body is hashed only under an authentic header. ``ts`` is the sender's wall
clock, ``nonce`` 16 random bytes (a reply echoes its request's), ``boot`` the boot id of
the server process the request is for (a reply carries its own server's).
:class:`KeyedGate` is a server's check of a request's envelope (MAC, clock, boot id,
replay, body) before any handler sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from vllm_omni_kv.wire.auth import ENV_KEY_FILE, MESSAGE_MAC_SIZE, AuthKey

__all__ = [
    "BOOT_SIZE",
    "NONCE_SIZE",
    "OVERHEAD",
    "Header",
    "KeyedGate",
    "body_of",
    "open_header",
    "seal",
]

VERSION = 1
NONCE_SIZE = 16
BOOT_SIZE = 16
DIGEST_SIZE = 32
_HEADER = struct.Struct(f"<Bd{NONCE_SIZE}s{BOOT_SIZE}sI{DIGEST_SIZE}s")
#: bytes a keyed message carries besides its body
OVERHEAD = _HEADER.size + MESSAGE_MAC_SIZE


@dataclass(frozen=True)
class Header:
    """An authenticated header: what it says about its message."""

    ts: float
    nonce: bytes
    boot: bytes
    body_len: int
    digest: bytes


def _digest(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=DIGEST_SIZE).digest()


def seal(
    msg: dict[str, Any],
    auth: AuthKey,
    *,
    nonce: bytes,
    boot: bytes,
    reply: bool = False,
    ts: float | None = None,
) -> bytes:
    """``msg`` as a keyed message for the server process ``boot``."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    head = _HEADER.pack(
        VERSION, time.time() if ts is None else ts, nonce, boot, len(body), _digest(body)
    )
    return head + auth.message_mac(head, reply=reply) + body


def open_header(raw: bytes, auth: AuthKey, *, reply: bool = False) -> Header | None:
    """The header of ``raw`` when its MAC matches (the body is not looked at), else None."""
    if len(raw) < OVERHEAD:
        return None
    head = raw[: _HEADER.size]
    mac = raw[_HEADER.size : OVERHEAD]
    if not hmac.compare_digest(auth.message_mac(head, reply=reply), mac):
        return None
    version, ts, nonce, boot, body_len, digest = _HEADER.unpack(head)
    if version != VERSION:
        return None
    return Header(ts, nonce, boot, body_len, digest)


def body_of(raw: bytes, header: Header) -> bytes | None:
    """The body of ``raw`` when it is the one ``header`` names (length and digest), else None."""
    body = memoryview(raw)[OVERHEAD:]
    if len(body) != header.body_len or not hmac.compare_digest(_digest(body), header.digest):
        return None
    return bytes(body)


class KeyedGate:
    """A keyed server's checks of a request before any handler sees it.

    :meth:`open` refuses (handler not run) a request whose header MAC does not match,
    whose ``ts`` is more than ``max_skew_s`` from this host's clock, whose nonce was
    seen in the last ``2 * max_skew_s`` (a replay), or whose body is not the one its
    header names; one that names another ``boot`` (sent to another server process, or
    to this server before it restarted) gets a ``retarget`` refusal, sealed, so that a
    client learns this server's boot id and resends. At most ``max_nonces`` nonces are
    remembered: beyond that requests are answered busy until old ones lapse.
    """

    def __init__(self, auth: AuthKey, boot: bytes, max_skew_s: float, max_nonces: int) -> None:
        self.auth, self.boot = auth, boot
        self.max_skew_s, self.max_nonces = max_skew_s, max_nonces
        self._nonces: set[bytes] = set()
        self._expiry: deque[tuple[float, bytes]] = deque()

    def open(self, raw: bytes, now: float) -> tuple[bytes | None, Header | None, dict[str, Any]]:
        """``(body, header, {})`` for a fresh authentic request; else ``(None, header or
        None, refusal)``, where a header is given when the refusal is to be sealed."""
        header = open_header(raw, self.auth)
        if header is None:
            return (
                None,
                None,
                _refusal(
                    "request not authenticated: its MAC is missing or made with another key; "
                    f"give every stage the same auth_key_file (or {ENV_KEY_FILE})"
                ),
            )
        skew = header.ts - time.time()
        if not abs(skew) <= self.max_skew_s:
            return (
                None,
                None,
                _refusal(
                    f"request refused: its timestamp is {skew:+.1f}s from this host's clock (at "
                    f"most {self.max_skew_s:g}s allowed): a replayed request, or clocks out of sync"
                ),
            )
        if not hmac.compare_digest(header.boot, self.boot):
            return None, header, {"ok": False, "reason": "retarget"}
        while self._expiry and self._expiry[0][0] <= now:
            self._nonces.discard(self._expiry.popleft()[1])
        if header.nonce in self._nonces:
            return None, None, _refusal("request refused: its nonce was already used (a replay)")
        if len(self._nonces) >= self.max_nonces:
            return None, None, {"ok": False, "reason": "busy"}
        self._nonces.add(header.nonce)
        self._expiry.append((now + 2 * self.max_skew_s, header.nonce))
        body = body_of(raw, header)
        if body is None:
            return None, None, _refusal("request refused: its body is not the one its MAC names")
        return body, header, {}


def _refusal(why: str) -> dict[str, Any]:
    return {"ok": False, "reason": "unauthenticated", "error": why}
