"""Small files in ``/dev/shm`` (index entries, holds) read as if an attacker wrote them."""

from __future__ import annotations

import os
import stat

from vllm_omni_kv.errors import KVPayloadError


def read_owned_file(file: str, max_bytes: int) -> bytes:
    """The bytes of ``file``, opened without following a link or blocking (a FIFO), and
    only if it is a regular file of this user of at most ``max_bytes``;
    ``KVPayloadError`` otherwise, ``FileNotFoundError`` when absent."""
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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
    finally:
        os.close(fd)
