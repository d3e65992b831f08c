"""The optional shared secret: keyed BLAKE2b MACs over frames and side-channel messages.

A deployment that sets ``auth_key_file`` (or the environment variable
:data:`ENV_KEY_FILE`) on every stage gives each process the same key. The key
file holds at least :data:`MIN_KEY_BYTES` bytes of secret: a text key (printable
ASCII, e.g. base64) loses its surrounding whitespace, a binary key is used byte for
byte, and keys longer than 64 bytes are hashed down to 64, BLAKE2b's key size. A shorter key, or a file that other users can
read or write, is refused with :class:`ConfigError`.

With a key, a frame's prelude carries :data:`~.prelude.FLAG_MAC` and its trailer
gains one 16-byte tag per chunk and a 32-byte MAC over prelude, header and
trailer (see :mod:`.codec`); a reader authenticates exactly the chunks it reads
and the head before the payload counts as loaded. :class:`AuthKey` objects never
show the key in their ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.wire.prelude import CHECKSUM_OFFSET, DIGEST_SIZE, HEAD_MAC_SIZE, TAG_SIZE, Prelude

#: environment variable naming the key file when ``auth_key_file`` is not configured
ENV_KEY_FILE = "OMNIKV_AUTH_KEY_FILE"
MIN_KEY_BYTES = 32
#: largest key file read (a key is a short secret, not a document)
MAX_KEY_FILE = 4096
MESSAGE_MAC_SIZE = 32

_PERSON_CHUNK = b"omnikv-chunk-v1"
_PERSON_HEAD = b"omnikv-head-v1"
_PERSON_REQUEST = b"omnikv-sc-req-v1"
_PERSON_REPLY = b"omnikv-sc-rep-v1"

NOT_AUTHENTICATED = (
    "the producer and this consumer use different auth keys, or the payload was forged or "
    f"altered: give every stage the same auth_key_file (or {ENV_KEY_FILE})"
)


class AuthKey:
    """A loaded shared secret; ``source`` names where it came from (never the key)."""

    __slots__ = ("_chunk", "_key", "source")

    def __init__(self, key: bytes, source: str = "<bytes>") -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(
                f"auth key from {source} has {len(key)} bytes; it needs at least "
                f"{MIN_KEY_BYTES} bytes of secret (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
            )
        if len(key) > 64:
            key = hashlib.blake2b(key, digest_size=64, person=b"omnikv-key-v1").digest()
        self._key = key
        self.source = source
        self._chunk = hashlib.blake2b(key=key, digest_size=TAG_SIZE, person=_PERSON_CHUNK)

    def __repr__(self) -> str:
        return f"AuthKey(<secret>, source={self.source!r})"

    # -- frames ---------------------------------------------------------------------
    def chunk_hasher(self) -> hashlib.blake2b:
        """A fresh keyed hasher for one chunk tag (a copy of a pre-keyed state)."""
        return self._chunk.copy()

    def chunk_tag(self, data: object) -> bytes:
        h = self._chunk.copy()
        h.update(data)  # type: ignore[arg-type]
        return h.digest()

    def head_hasher(self) -> hashlib.blake2b:
        return hashlib.blake2b(key=self._key, digest_size=HEAD_MAC_SIZE, person=_PERSON_HEAD)

    # -- side-channel messages ------------------------------------------------------
    def message_mac(self, body: bytes, *, reply: bool) -> bytes:
        person = _PERSON_REPLY if reply else _PERSON_REQUEST
        return hashlib.blake2b(
            body, key=self._key, digest_size=MESSAGE_MAC_SIZE, person=person
        ).digest()

    def same_key(self, other: AuthKey) -> bool:
        return hmac.compare_digest(self._key, other._key)


def check_tag(expected: bytes | memoryview, got: bytes, what: str) -> None:
    """Raise ``KVPayloadError`` unless ``got`` equals ``expected`` (constant time)."""
    if not hmac.compare_digest(bytes(expected), got):
        raise KVPayloadError(f"{what} is not authenticated: {NOT_AUTHENTICATED}")


def check_keying(keyed: bool, auth: AuthKey | None) -> None:
    """The policy both ways: a keyed frame needs a key here, a key here needs a keyed frame."""
    if keyed and auth is None:
        raise KVPayloadError(
            "the producer authenticates its payloads with a shared key and this consumer has "
            f"none: set the same auth_key_file (or {ENV_KEY_FILE}) on this stage"
        )
    if not keyed and auth is not None:
        raise KVPayloadError(
            "payload not authenticated: it carries no MAC and this consumer requires one "
            f"(auth key from {auth.source}); give the producer the same auth_key_file"
        )


def head_mac(mv: memoryview, p: Prelude, auth: AuthKey) -> bytes:
    """MAC over the prelude (less its checksum field), header + padding and the trailer's
    digests and chunk tags (the chunk tags authenticate the data)."""
    h = auth.head_hasher()
    h.update(mv[:CHECKSUM_OFFSET])
    h.update(mv[CHECKSUM_OFFSET + DIGEST_SIZE : p.data_start])
    h.update(mv[p.trailer_start : p.head_mac_start])
    return h.digest()


def verify_head_mac(mv: memoryview, p: Prelude, auth: AuthKey) -> None:
    check_keying(p.keyed, auth)
    expected = mv[p.head_mac_start : p.head_mac_start + HEAD_MAC_SIZE]
    check_tag(expected, head_mac(mv, p, auth), "frame header")


def verify_chunk_tag(
    mv: memoryview,
    tags_start: int,
    k: int,
    start: int,
    end: int,
    auth: AuthKey,
    data: object = None,
) -> None:
    """Check chunk ``k`` (frame bytes ``[start, end)``, or ``data``) against its keyed tag."""
    at = tags_start + TAG_SIZE * k
    got = auth.chunk_tag(mv[start:end] if data is None else data)
    check_tag(mv[at : at + TAG_SIZE], got, f"chunk {k} (frame bytes [{start}, {end}))")


def load_key_file(path: str | os.PathLike[str]) -> AuthKey:
    """Read a key file once; refuse a short key and a file other users can read or write."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as e:
        raise ConfigError(f"auth_key_file {str(p)!r} cannot be read: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"auth_key_file {str(p)!r} is not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"auth_key_file {str(p)!r} has mode {stat.S_IMODE(st.st_mode):o}: other users can "
            f"access it; make it private with `chmod 600 {p}`"
        )
    if st.st_size > MAX_KEY_FILE:
        raise ConfigError(
            f"auth_key_file {str(p)!r} has {st.st_size} bytes; a key file holds a short "
            f"secret (at most {MAX_KEY_FILE} bytes)"
        )
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"auth_key_file {str(p)!r} cannot be read: {e}") from None
    # a text key (base64, hex) written with a trailing newline; a binary one is used as is
    key = raw.strip() if all(32 <= b < 127 or b in b"\t\n\r " for b in raw) else raw
    return AuthKey(key, str(p))


def key_file_setting(configured: object) -> str | None:
    """The key file to use: ``configured`` (a path), else :data:`ENV_KEY_FILE`, else None."""
    if configured is not None:
        if not isinstance(configured, (str, os.PathLike)) or not str(configured):
            raise ConfigError(f"auth_key_file must be a file path, got {configured!r}")
        return str(configured)
    env = os.environ.get(ENV_KEY_FILE, "")
    return env or None


def key_from_config(configured: object) -> AuthKey | None:
    """:func:`load_key_file` of :func:`key_file_setting`, or None without a key."""
    path = key_file_setting(configured)
    return None if path is None else load_key_file(path)


def auth_of(config: Mapping[str, Any]) -> AuthKey | None:
    """A backend's key: ``auth_key`` (an :class:`AuthKey`, as the vLLM connector passes
    it), else the file ``auth_key_file``, else :data:`ENV_KEY_FILE`, else None."""
    key = config.get("auth_key")
    if key is not None:
        if not isinstance(key, AuthKey):
            raise ConfigError("auth_key must be a loaded AuthKey; configure auth_key_file instead")
        return key
    return key_from_config(config.get("auth_key_file"))
