"""Hold files: a producer's hold on the blocks of one payload, in ``/dev/shm``.

:class:`HoldFiles` (the shared-memory and CUDA IPC cache regions): one file per payload,
``omnikv_hold_<ns>_<digest of edge and key>``, owner-only, naming the cache segment. A
reader opens it, takes an exclusive ``flock``, checks it is still linked, copies, then
unlinks it and closes (dropping the lock). The producer takes a hold back only when a
non-blocking ``flock`` succeeds, and unlinks it under that lock, so it never takes back
a hold a reader is copying under, and a reader never copies under a hold that was
taken back. A reader that dies drops its lock with its process, in any PID namespace.
A reader that stops (SIGSTOP) or hangs keeps its lock: once the payload's lease and its
grace are over the producer takes the hold back anyway (:meth:`HoldFiles.expire_hold`),
marking it first, so that the reader's copy fails when it resumes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: what a producer appends to a hold file whose blocks were freed (see HoldFiles.revoke)
REVOKED = b"\0revoked"
#: what it appends to a hold it took back from a reader past the lease and its grace
EXPIRED = b"\0expired"
#: what it appends to a hold whose cache vLLM's sleep mode discards (see HoldFiles.void_holds)
SLEPT = b"\0asleep_"
#: why a hold's name opens no file of ours: absent, a link (O_NOFOLLOW), a FIFO without
#: a reader (O_WRONLY | O_NONBLOCK), another user's file
_NOT_OURS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EPERM})


class HoldFiles:
    """Hold files of one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
        self.tag = arena.namespace_tag(namespace)
        self.owner_name = ""  # producer: the segment its holds name (for the sweeper)
        self._mine: set[str] = set()
        self._lock = threading.Lock()

    def hold_name(self, from_stage: str, to_stage: str, key: str) -> str:
        digest = hashlib.blake2b(f"{from_stage}\0{to_stage}\0{key}".encode(), digest_size=16)
        return f"{arena.HOLD_PREFIX}{self.tag}_{digest.hexdigest()}"

    def hold(self, from_stage: str, to_stage: str, key: str) -> str:
        name = self.hold_name(from_stage, to_stage, key)
        try:
            fd = os.open(arena.path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KVTransferError(
                f"a hold for key {key!r} on {from_stage}->{to_stage} already exists: use a "
                "unique key per transfer"
            ) from None
        except OSError as e:
            raise KVTransferError(f"cannot create hold file {name}: {e}") from e
        try:
            os.write(fd, self.owner_name.encode("ascii"))
        finally:
            os.close(fd)
        with self._lock:
            self._mine.add(name)
        return name

    def released(self, hold: str) -> bool:
        if os.path.exists(arena.path(hold)):
            return False
        with self._lock:
            self._mine.discard(hold)
        return True

    def revoke(self, hold: str, mark: bytes = REVOKED) -> None:
        """Append ``mark`` to the hold file: a reader copying under it checks the file
        after its copy and fails (the lock is advisory, so this never waits)."""
        if not self._mark(hold, mark):
            logger.warning("could not mark hold %s %r: a reader may not be told", hold, mark)

    def _mark(self, hold: str, mark: bytes) -> bool:
        """Append ``mark``; True when written or when there is no hold to mark."""
        try:
            fd = _open_hold(hold, os.O_WRONLY | os.O_APPEND)
            if fd is None:
                return True  # gone: released or taken back, nobody reads under it
            try:
                return os.write(fd, mark) == len(mark)
            finally:
                os.close(fd)
        except OSError:
            return False

    def expire_hold(self, hold: str) -> bool:
        """Take ``hold`` back although a reader may hold its lock (it kept it past the
        lease and its grace): mark it :data:`EXPIRED`, then unlink it. The reader's copy,
        whenever it ends, sees the mark and fails."""
        if not self._mark(hold, EXPIRED):
            return False  # its reader could not be told: the blocks stay held
        arena.unlink_quiet(hold)
        with self._lock:
            self._mine.discard(hold)
        return True

    def take_back(self, hold: str) -> bool:
        try:
            fd = _open_hold(hold, os.O_RDONLY)
        except OSError as e:  # the hold may be ours and read under: keep the blocks
            logger.warning("cannot open hold %s to take it back: %s", hold, e)
            return False
        if fd is None:  # released (a file planted under its name since is not ours)
            with self._lock:
                self._mine.discard(hold)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # a reader is copying under it
            raise
        try:
            if os.fstat(fd).st_nlink:
                arena.unlink_quiet(hold)
        finally:
            os.close(fd)
        with self._lock:
            self._mine.discard(hold)
        return True

    @contextlib.contextmanager
    def reading(self, hold: Any) -> Iterator[None]:
        if not isinstance(hold, str) or not hold.startswith(arena.HOLD_PREFIX) or "/" in hold:
            raise KVPayloadError(f"shared-pages payload names no valid hold: {hold!r}")
        try:
            fd = _open_hold(hold, os.O_RDONLY)
        except OSError as e:
            raise KVTransferError(f"cannot open the payload's hold {hold}: {e}") from e
        if fd is None:
            raise KVTransferError(
                "the producer already took back this payload's blocks (its lease ran out "
                "before the copy began): the request is recomputed"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a regular file of ours: held only briefly
            st = os.fstat(fd)
            if not st.st_nlink:
                raise KVTransferError(
                    "the producer took back this payload's blocks as the copy began (its "
                    "lease ran out): the request is recomputed"
                )
            try:
                yield
                if os.fstat(fd).st_size != st.st_size:  # revoked while we copied
                    raise _revoked(os.pread(fd, len(EXPIRED), st.st_size))
            finally:
                arena.unlink_quiet(hold)
        finally:
            os.close(fd)  # drops the lock

    def release(self, hold: str) -> None:
        if hold.startswith(arena.HOLD_PREFIX) and "/" not in hold:
            arena.unlink_quiet(hold)

    def void_holds(self) -> None:
        """Producer: the cache is going away (vLLM's sleep): mark every hold of this
        process :data:`SLEPT` and unlink it; a reader copying under one fails when its
        copy ends, a reader yet to begin finds it gone."""
        with self._lock:
            mine, self._mine = list(self._mine), set()
        for name in mine:
            self.revoke(name, SLEPT)
            arena.unlink_quiet(name)

    def close_holds(self) -> None:
        with self._lock:
            mine, self._mine = list(self._mine), set()
        for name in mine:
            arena.unlink_quiet(name)


def _open_hold(hold: str, flags: int) -> int | None:
    """``hold``'s file opened with ``flags``, or None where there is none of ours: absent,
    or something else planted under its name (a FIFO, a link, another user's file), which
    is never waited on (``O_NONBLOCK``) nor written. Any other failure (no descriptor
    left) raises ``OSError``: the hold may still be ours."""
    try:
        fd = os.open(arena.path(hold), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _NOT_OURS:
            return None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


def _revoked(mark: bytes) -> KVTransferError:
    """Why a copy under a hold marked ``mark`` failed."""
    if mark == SLEPT:
        return KVTransferError(
            "the producer's KV cache was put to sleep (vLLM sleep mode) while its blocks "
            "were copied: the request is recomputed"
        )
    if mark == EXPIRED:
        return KVTransferError(
            "this copy outlived the payload's lease and its grace (hold_grace): the producer "
            "took its blocks back (they may be reused); the request is recomputed"
        )
    return KVTransferError(
        "the producer's request was preempted while its blocks were copied (they may be "
        "reused): the request is recomputed"
    )
