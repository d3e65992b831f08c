"""Small files in ``/dev/shm`` (index entries, holds) read as if an attacker wrote them, and
the inline index entry (a small frame carried in the entry itself)."""

from __future__ import annotations

import os
import stat
import struct

from vllm_omni_kv.backends.shm.liveness import owner_ident
from vllm_omni_kv.errors import KVPayloadError


def read_owned_file(file: str, max_bytes: int) -> bytes:
    """The bytes of ``file``, opened without following a link or blocking (a FIFO), and
    only if it is a regular file of this user of at most ``max_bytes``;
    ``KVPayloadError`` otherwise, ``FileNotFoundError`` when absent."""
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return read_owned_fd(fd, file, max_bytes)
    finally:
        os.close(fd)


def read_owned_fd(fd: int, file: str, max_bytes: int) -> bytes:
    """The bytes of ``file`` open as ``fd`` at offset 0 (see :func:`read_owned_file`); ``fd`` stays open."""
    try:
        st = os.fstat(fd)
        name = os.path.basename(file)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise KVPayloadError(
                f"shared-memory file {name} is not a regular file of this user: refused "
                "(someone else wrote into /dev/shm)"
            )
        if st.st_size > max_bytes:
            raise KVPayloadError(
                f"shared-memory file {name} holds {st.st_size} bytes, over the {max_bytes}-byte "
                "bound of an index entry: refused"
            )
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise KVPayloadError(f"cannot read shared-memory file {file}: {e}") from e


#: an inline index entry: ``b"O"`` + the producer's pid and identity (``ident``, u64 each)
#: + the frame (``b"I"`` + frame, without an owner, is still read)
INLINE_OWNED = b"O"
_INLINE_HEAD = struct.Struct("<QQ")


def inline_entry(frame: bytes | bytearray) -> bytes:
    """The index entry of a small frame carried inline, naming this process as its owner."""
    return INLINE_OWNED + _INLINE_HEAD.pack(os.getpid(), owner_ident()) + bytes(frame)


def inline_frame(entry: bytes) -> bytes | None:
    """The frame of an inline index entry; None for a segment reference."""
    if entry[:1] == b"I":
        return entry[1:]
    if entry[:1] == INLINE_OWNED:
        return entry[1 + _INLINE_HEAD.size :]
    return None


def inline_owner(entry: bytes) -> tuple[int, int] | None:
    """``(pid, ident)`` of an owned inline entry's producer (see ``liveness.owner_ident``)."""
    if entry[:1] != INLINE_OWNED or len(entry) < 1 + _INLINE_HEAD.size:
        return None
    pid, pidns = _INLINE_HEAD.unpack_from(entry, 1)
    return int(pid), int(pidns)
