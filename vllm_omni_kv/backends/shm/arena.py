"""Persistent shared-memory arena behind :class:`SharedMemoryConnector`.

Allocating tmpfs pages is the dominant cost of a fresh segment (the kernel
zeroes every page), and mapping one costs a page-table walk. So a producer
keeps a few large segments mapped for its whole life and reuses them; a
consumer caches its mappings of them. Files in ``/dev/shm``:

* ``omnikv_seg_<pid>_<ns>_<id>`` - an arena segment of the producer ``pid`` (``ns``: a
  short hash of the backend's ``namespace``, so tools can tell namespaces apart). Its first
  64 bytes are a slot header of eight ``u64`` words: ``state | generation | progress |
  abandoned | owner | beat | pidns | reader``; the frame follows at offset 64. States: FREE,
  PUBLISHED (a reader may claim it), ONESHOT (a one-off segment the reader
  unlinks after use; also "reserved" while a producer writes a pooled one),
  STREAMING (published while the producer is still writing: ``progress`` leading
  frame bytes are final) and ABORTED (the producer failed mid-write).
* ``omnikv_idx_<ns>_<digest>`` - the index entry of one key: ``b"R"`` (complete) or
  ``b"S"`` (streamed: possibly still being written) + msgpack ``{seg, gen, size,
  pid, pooled, owner}`` pointing into a segment, or ``b"O"`` + the producer's pid and
  identity (``ident``, see liveness) + an inline frame for small payloads (swept once that
  process is gone, when it is in our PID namespace). Written under a temporary name then
  renamed, so readers never see half of one; claimed by renaming (one reader wins).
* ``omnikv_hold_<ns>_<digest>`` - the hold on the blocks of one shared-pages payload
  (:mod:`vllm_omni_kv.backends.shm.cache_region`): it names the producer's cache
  segment (``omnikv_seg_<pid>_<ns>_kv<id>``, the KV cache itself at offset 4096), a
  reader locks it while copying and unlinks it when done.

The consumer (:mod:`vllm_omni_kv.backends.shm.reader`) returns a segment to its
producer (state FREE) when the last tensor view of the decoded object is garbage
collected (for a stream: once it is also closed). A streaming reader that gives
up before the producer finished writes the generation into ``abandoned``
instead, and the producer frees the segment: each field has a single writer at
any time, so no atomic operations are needed.

Liveness (:mod:`vllm_omni_kv.backends.shm.liveness`): ``owner`` is a random per-process
instance id, ``pidns`` the owner's identity (PID namespace and start time), and a producer
thread (:mod:`vllm_omni_kv.backends.shm.producer`) rewrites ``beat`` in every segment it
owns each ``HEARTBEAT_S``. An owner in our PID namespace is alive while its pid runs with
that start time; one in another namespace while its beat is younger than
``heartbeat_stale_s``. A reader that claims a segment keeps its lease in ``reader`` fresh
while it holds it; the producer frees (or, for a one-off segment, unlinks) a claimed
segment whose reader lease went stale, so a reader killed after claiming returns it.
Files of dead processes are swept by :func:`sweep_orphans`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from vllm_omni_kv.backends.shm.entry_files import inline_frame, inline_owner, read_owned_file
from vllm_omni_kv.backends.shm.liveness import (
    HEARTBEAT_S,
    STALE_S,
    W_BEAT,
    W_OWNER,
    W_PIDNS,
    W_READER,
    in_our_namespace,
    local_verdict,
    owner_alive,
    pid_alive,
)
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import bounded

logger = init_logger(__name__)

__all__ = [
    "HEARTBEAT_S",
    "STALE_S",
    "W_BEAT",
    "W_OWNER",
    "W_PIDNS",
    "W_READER",
    "owner_alive",
    "pid_alive",
    "sweep_orphans",
    "sweepable",
]

#: where the shared-memory files live: a tmpfs every stage on the host sees (a directory on
#: one, e.g. ``/dev/shm/omnikv-a``, separates deployments like ``namespace`` does)
SHM_DIR = os.environ.get("OMNIKV_SHM_DIR", "/dev/shm")
PREFIX = "omnikv_"
SEG_PREFIX = PREFIX + "seg_"
IDX_PREFIX = PREFIX + "idx_"
HOLD_PREFIX = PREFIX + "hold_"
#: the largest index entry a reader accepts (inline frames: ``shm_threshold_bytes`` <= it)
MAX_INDEX_BYTES = 16 << 20
#: the largest segment reference (``b"R"``/``b"S"`` entry) decoded: a map of five fields
MAX_REF_BYTES = 4096
SLOT_WORDS = 8  # state, generation, progress, abandoned, owner, beat, pidns, reader: u64 each
DATA_OFFSET = 64
FREE, PUBLISHED, ONESHOT, STREAMING, ABORTED = 0, 1, 2, 3, 4
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def read_header(name: str) -> list[int] | None:
    """The slot header of segment ``name`` without mapping it (opened without following a
    link or blocking on a FIFO); None when shorter, or not a regular file."""
    fd = os.open(path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return header_of(fd)
    finally:
        os.close(fd)


def header_of(fd: int) -> list[int] | None:
    """The slot header of the segment open as ``fd``; None when shorter, or not a regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return None
    raw = os.pread(fd, DATA_OFFSET, 0)
    if len(raw) < DATA_OFFSET:
        return None
    return [int(x) for x in np.frombuffer(raw, dtype="<u8", count=SLOT_WORDS)]


def size_class(n: int) -> int:
    """Round ``n`` up so that segments are reusable across similar payloads (<=12.5% slack)."""
    n = max(n, 1 << 20)
    step = 1 << max(n.bit_length() - 4, 12)
    return (n + step - 1) // step * step


@functools.lru_cache(maxsize=64)
def namespace_tag(namespace: str) -> str:
    """The short tag every file of ``namespace`` carries in its name."""
    return hashlib.blake2b(namespace.encode(), digest_size=4).hexdigest()


def namespace_files(namespace: str) -> set[str]:
    """Names of the arena files (segments, index entries, claims) of ``namespace``."""
    tag = namespace_tag(namespace)
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        if n.startswith((IDX_PREFIX + tag + "_", HOLD_PREFIX + tag + "_")):
            out.add(n)
        elif n.startswith(SEG_PREFIX) and n[len(SEG_PREFIX) :].split("_")[1:2] == [tag]:
            out.add(n)
    return out


#: the id of an exported cache's segment starts with one of these: a host KV cache (``kv``,
#: :mod:`~vllm_omni_kv.backends.shm.cache_region`), a CUDA IPC cache's heartbeat (``ipc``)
CACHE_IDS = ("kv", "ipc")


def file_kind(name: str) -> str:
    """What arena file ``name`` is: ``segment`` (a payload segment), ``cache`` (the segment
    of an exported cache), ``index`` (a published index entry), ``transient`` (an index
    entry being written or claimed), ``hold``; ``""`` for no arena file."""
    if name.startswith(IDX_PREFIX):
        return "transient" if ".claim" in name or ".tmp" in name else "index"
    if name.startswith(SEG_PREFIX):
        return "cache" if name.rsplit("_", 1)[-1].startswith(CACHE_IDS) else "segment"
    return "hold" if name.startswith(HOLD_PREFIX) else ""


def ref_fields(entry: bytes) -> Any:
    """The decoded body of a segment-reference entry; ``ValueError`` for one over
    :data:`MAX_REF_BYTES` or not msgpack (decoded by :mod:`vllm_omni_kv.wire.bounded`)."""
    if len(entry) - 1 > MAX_REF_BYTES:
        raise ValueError(
            f"segment reference of {len(entry) - 1} bytes: not one of ours (at most "
            f"{MAX_REF_BYTES})"
        )
    return bounded.unpackb(entry[1:], strict_map_key=True)


def entry_frame_bytes(entry: bytes) -> int:
    """The frame bytes the index entry ``entry`` publishes (inline, or in a segment)."""
    frame = inline_frame(entry)
    return len(frame) if frame is not None else int(ref_fields(entry)["size"])


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_quiet(name: str) -> bool:
    try:
        os.unlink(path(name))
        return True
    except FileNotFoundError:
        return False


#: what a full /dev/shm error suggests by default
NO_ROOM_ADVICE = (
    "enlarge it (Docker: --shm-size), lower the shared-memory backend's max_bytes, or use "
    "another backend"
)


def _no_room(what: str, err: OSError, advice: str = NO_ROOM_ADVICE) -> KVTransferError:
    try:
        st = os.statvfs(SHM_DIR)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return KVTransferError(f"{SHM_DIR} has no room for {what} ({free}; {err.strerror}): {advice}")


def _create_file(
    name: str, size: int, head: bytes = b"", what: str = "", advice: str = NO_ROOM_ADVICE
) -> int:
    """Create an owner-only file of ``size`` bytes whose pages are reserved up front, so a
    full ``/dev/shm`` is an error here rather than a SIGBUS when the bytes are written
    (``KVTransferError`` naming ``what`` the file is for and the ``advice``).
    ``head`` is written first, so a sweeper sees a segment's heartbeat from the start."""
    fd = os.open(path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if head:
            os.pwrite(fd, head, 0)
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except BaseException as e:
        os.close(fd)
        unlink_quiet(name)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _no_room(what or f"a {size}-byte segment", e, advice) from None
        raise
    return fd


@dataclass
class Segment:
    name: str
    capacity: int  # frame bytes it can hold (excludes the slot header)
    mm: mmap.mmap
    last_use: int = 0  # producer-side acquire counter: the highest is the most cache-hot
    index: str | None = None  # producer side: the index entry of the published generation
    claimed_at: float | None = None  # producer side: when it saw a claim without a lease
    _words: np.ndarray | None = None

    def words(self) -> np.ndarray:
        """The slot header as eight ``u64`` words. Each field is written with one aligned
        8-byte store, so other processes never see it half written (``struct.pack_into``
        zeroes its target first, which a concurrent reader could observe)."""
        if self._words is None:
            self._words = np.frombuffer(self.mm, dtype="<u8", count=SLOT_WORDS)
        return self._words

    def state(self) -> tuple[int, int]:
        w = self.words()
        return int(w[0]), int(w[1])

    def set_state(self, state: int, gen: int) -> None:
        w = self.words()
        w[1] = gen
        w[0] = state

    def full_state(self) -> tuple[int, int, int, int]:
        """``(state, generation, progress, abandoned)``, read in that order."""
        st, gen, progress, abandoned = self.words()[:4].tolist()
        return st, gen, progress, abandoned

    def set_progress(self, nbytes: int) -> None:
        self.words()[2] = nbytes

    def abandon(self, gen: int) -> None:
        """Reader side: give up on generation ``gen`` before its producer finished."""
        self.words()[3] = gen

    def reusable(self) -> bool:
        st, gen, _progress, abandoned = self.full_state()
        return st == FREE or (abandoned == gen and st in (PUBLISHED, ABORTED))

    def unmap(self) -> None:
        self._words = None
        close_map(self.mm)


def exported(mm: mmap.mmap) -> memoryview:
    """What to hand ``torch.frombuffer`` for a tensor over ``mm``: torch keeps the object
    it is given alive but not a buffer export of it, so a tensor made from the mapping
    itself would not stop :func:`close_map` from unmapping it under the tensor (the next
    read of the tensor then crashes the process). The memoryview holds the export for as
    long as any tensor over it lives."""
    return memoryview(mm)


def close_map(mm: mmap.mmap) -> None:
    """Unmap ``mm`` (a :class:`~.pinned_map.PinnedMap` unregisters itself first)."""
    try:
        mm.close()
    except BufferError:  # views still alive somewhere: the GC unmaps it later
        pass


def read_entry(name: str) -> bytes:
    """The bytes of index entry (or hold) ``name``, opened defensively (see
    :func:`~vllm_omni_kv.backends.shm.entry_files.read_owned_file`)."""
    return read_owned_file(path(name), MAX_INDEX_BYTES)


def claim_index(name: str) -> bytes | None:
    """Atomically take the index entry ``name``; None when absent. ``KVPayloadError`` for
    an entry that is no regular file of this user (see :func:`read_entry`)."""
    claimed = f"{name}.claim{os.getpid()}_{os.urandom(6).hex()}"
    try:
        os.rename(path(name), path(claimed))
    except FileNotFoundError:
        return None
    try:
        return read_entry(claimed)
    except FileNotFoundError:
        return None
    except OSError as e:  # O_NOFOLLOW on a link: ELOOP
        raise KVPayloadError(f"shared-memory index entry {name} refused: {e}") from e
    finally:
        unlink_quiet(claimed)


def _owner_pid(name: str) -> int | None:
    try:
        if name.startswith(SEG_PREFIX):
            return int(name[len(SEG_PREFIX) :].split("_", 1)[0])
        if name.startswith(HOLD_PREFIX):  # the producer whose cache segment it names
            seg = _hold_segment(name)
            return _owner_pid(seg) if seg is not None else None
        if ".claim" in name:
            return int(name.split(".claim", 1)[1].split("_", 1)[0])
        if name.startswith(IDX_PREFIX) and ".tmp" not in name:
            entry = read_entry(name)
            if entry[:1] in (b"R", b"S"):
                return int(ref_fields(entry)["pid"])
            owner = inline_owner(entry)
            if owner is not None and in_our_namespace(owner[1]):
                return owner[0]
    except (ValueError, KeyError, OSError, TypeError, msgpack.UnpackException):
        return None
    return None


def _hold_segment(name: str) -> str | None:
    """The cache segment a hold file names; None while it is being written (or not ours)."""
    try:
        seg = read_entry(name)[:256].decode("ascii", "replace")
    except KVPayloadError:
        return None
    return seg if seg.startswith(SEG_PREFIX) and "/" not in seg else None


def _orphaned(name: str, st: os.stat_result, stale_s: float) -> bool:
    """Whether the arena file ``name`` (status ``st``) belongs to no live process."""
    if ".claim" in name or ".tmp" in name:
        # lives microseconds (claimed, read, unlinked; or written, renamed): a pid in its
        # name means nothing across PID namespaces, so only its age counts
        return time.time() - st.st_ctime > stale_s
    if name.startswith(SEG_PREFIX):
        return _segment_orphaned(name, _owner_pid(name), stale_s)
    if name.startswith(HOLD_PREFIX):  # goes with the cache segment it names
        seg = _hold_segment(name)
        if seg is None:
            return time.time() - st.st_ctime > stale_s  # being created, or not ours
        return _segment_orphaned(seg, _owner_pid(seg), stale_s)
    if name.startswith(IDX_PREFIX):
        try:
            entry = read_entry(name)
        except KVPayloadError:
            return False  # not ours to judge (another user's, a link, a FIFO)
        if entry[:1] not in (b"R", b"S"):
            owner = inline_owner(entry)  # gone with its producer; in another PID namespace
            alive = None if owner is None else local_verdict(owner[1], owner[0])
            return alive is False  # a pid means nothing: its producer withdraws it
        ref = ref_fields(entry)
        seg = ref["seg"]
        if not isinstance(seg, str) or not seg.startswith(SEG_PREFIX) or "/" in seg:
            return False
        return _segment_orphaned(seg, int(ref["pid"]), stale_s)
    return False


def _segment_orphaned(seg: str, pid: int | None, stale_s: float) -> bool:
    try:
        words = read_header(seg)
    except FileNotFoundError:
        return True  # an index entry whose segment is gone
    if words is None:  # no header: an older version's file, or one being created
        return pid is not None and not pid_alive(pid)
    return not owner_alive(words, pid, stale_s)


def sweepable(name: str, stale_s: float = STALE_S) -> bool:
    """Whether :func:`sweep_orphans` removes the arena file ``name``: a regular file of this
    user whose owner is gone. ``FileNotFoundError`` when it is gone; reads, never writes."""
    st = os.lstat(path(name))
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        return False  # another user's file, or a planted link: not ours to judge
    try:
        return _orphaned(name, st, stale_s)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException):
        return False  # unreadable: not recognisably ours


def sweep_orphans(stale_s: float = STALE_S) -> list[str]:
    """Unlink this user's arena files whose owner is gone; return their names.

    A segment's owner is gone when, in our PID namespace, its pid no longer runs with the
    recorded start time, or, in another, its heartbeat is older than ``stale_s``
    (:mod:`~vllm_omni_kv.backends.shm.liveness`); an index entry goes with its segment; a
    claim or temporary file once it is ``stale_s`` old. Another user's files are never
    touched, and a file that cannot be removed is logged and skipped.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            if sweepable(name, stale_s) and unlink_quiet(name):
                removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:  # never fail an engine start over a file we cannot remove
            logger.warning("left orphaned shared-memory file %s in place: %s", path(name), e)
    return removed
