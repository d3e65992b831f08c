"""Persistent shared-memory arena behind :class:`SharedMemoryConnector`.

Allocating tmpfs pages is the dominant cost of a fresh segment (the kernel
zeroes every page), and mapping one costs a page-table walk. So a producer
keeps a few large segments mapped for its whole life and reuses them; a
consumer caches its mappings of them. Files in ``/dev/shm``:

* ``omnikv_seg_<pid>_<ns>_<id>`` - an arena segment of the producer ``pid`` (``ns``: a
  short hash of the backend's ``namespace``, so tools can tell namespaces apart). Its first
  64 bytes are a slot header: ``u64 state | u64 generation | u64 progress |
  u64 abandoned``; the frame follows at offset 64. States: FREE,
  PUBLISHED (a reader may claim it), ONESHOT (a one-off segment the reader
  unlinks after use; also "reserved" while a producer writes a pooled one),
  STREAMING (published while the producer is still writing: ``progress`` leading
  frame bytes are final) and ABORTED (the producer failed mid-write).
* ``omnikv_idx_<ns>_<digest>`` - the index entry of one key: ``b"R"`` (complete) or
  ``b"S"`` (streamed: possibly still being written) + msgpack ``{seg, gen, size,
  pid, pooled}`` pointing into a segment, or ``b"I"`` + an inline frame for small
  payloads. Written under a temporary name then renamed, so readers never see
  half of one; claimed by renaming (one reader wins).

The consumer (:mod:`vllm_omni_kv.backends.shm.reader`) returns a segment to its
producer (state FREE) when the last tensor view of the decoded object is garbage
collected (for a stream: once it is also closed). A streaming reader that gives
up before the producer finished writes the generation into ``abandoned``
instead, and the producer frees the segment: each field has a single writer at
any time, so no atomic operations are needed.
Files of dead processes are swept by :func:`sweep_orphans`.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
import uuid
from dataclasses import dataclass

import msgpack
import numpy as np

from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "omnikv_"
SEG_PREFIX = PREFIX + "seg_"
IDX_PREFIX = PREFIX + "idx_"
SLOT_WORDS = 4  # state, generation, progress, abandoned: u64 each
DATA_OFFSET = 64
FREE, PUBLISHED, ONESHOT, STREAMING, ABORTED = 0, 1, 2, 3, 4
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def size_class(n: int) -> int:
    """Round ``n`` up so that segments are reusable across similar payloads (<=12.5% slack)."""
    n = max(n, 1 << 20)
    step = 1 << max(n.bit_length() - 4, 12)
    return (n + step - 1) // step * step


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
        if n.startswith(IDX_PREFIX + tag + "_"):
            out.add(n)
        elif n.startswith(SEG_PREFIX) and n[len(SEG_PREFIX) :].split("_")[1:2] == [tag]:
            out.add(n)
    return out


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_quiet(name: str) -> bool:
    try:
        os.unlink(path(name))
        return True
    except FileNotFoundError:
        return False


def _no_room(what: str, err: OSError) -> KVTransferError:
    try:
        st = os.statvfs(SHM_DIR)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return KVTransferError(
        f"{SHM_DIR} has no room for {what} ({free}; {err.strerror}): enlarge it (Docker: "
        "--shm-size), lower the shared-memory backend's max_bytes, or use another backend"
    )


def _create_file(name: str, size: int) -> int:
    """Create an owner-only file of ``size`` bytes whose pages are reserved up front, so a
    full ``/dev/shm`` is an error here rather than a SIGBUS when the bytes are written."""
    fd = os.open(path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except BaseException as e:
        os.close(fd)
        unlink_quiet(name)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _no_room(f"a {size}-byte segment", e) from None
        raise
    return fd


@dataclass
class Segment:
    name: str
    capacity: int  # frame bytes it can hold (excludes the slot header)
    mm: mmap.mmap
    last_use: int = 0  # producer-side acquire counter: the highest is the most cache-hot
    _words: np.ndarray | None = None

    def words(self) -> np.ndarray:
        """The slot header as four ``u64`` words. Each field is written with one aligned
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
        st, gen, progress, abandoned = self.words().tolist()
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


class ProducerArena:
    """The segments one producer process owns and reuses."""

    def __init__(self, max_bytes: int, populate: bool = True, namespace: str = "default") -> None:
        self.max_bytes = max_bytes
        self.populate = populate
        self.pid = os.getpid()
        self.tag = namespace_tag(namespace)
        self._segments: list[Segment] = []
        self._uses = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return sum(s.capacity for s in self._segments)

    def acquire(self, nbytes: int) -> tuple[Segment, bool]:
        """A segment able to hold ``nbytes``; ``(segment, pooled)``. One-shot when the pool is full."""
        with self._lock:
            self._uses += 1
            best: Segment | None = None
            for seg in self._segments:
                if seg.capacity >= nbytes and seg.reusable():
                    # smallest fit; among equals the most recently used (its pages are
                    # likely still in the CPU cache, so rewriting them avoids DRAM reads)
                    if best is None or (seg.capacity, -seg.last_use) < (
                        best.capacity,
                        -best.last_use,
                    ):
                        best = seg
            if best is not None:
                best.set_state(ONESHOT, best.state()[1])  # reserved: not FREE while we write
                best.last_use = self._uses
                return best, True
            cap = size_class(nbytes)
            pooled = self.total_bytes + cap <= self.max_bytes
            seg = self._new_segment(cap if pooled else nbytes)
            seg.set_state(ONESHOT, 0)
            seg.last_use = self._uses
            if pooled:
                self._segments.append(seg)
            return seg, pooled

    def _new_segment(self, capacity: int) -> Segment:
        name = f"{SEG_PREFIX}{self.pid}_{self.tag}_{uuid.uuid4().hex[:16]}"
        fd = _create_file(name, DATA_OFFSET + capacity)
        try:
            flags = mmap.MAP_SHARED | (POPULATE if self.populate else 0)
            mm = mmap.mmap(fd, DATA_OFFSET + capacity, flags=flags)
        except BaseException:
            unlink_quiet(name)
            raise
        finally:
            os.close(fd)
        return Segment(name, capacity, mm)

    def finish_stream(self, seg: Segment, state: int, gen: int) -> None:
        """Mark a streamed segment terminal; free it at once when its reader gave up."""
        with self._lock:
            seg.set_state(state, gen)
            if seg.full_state()[3] == gen:
                seg.set_state(FREE, gen)

    def release_unpublished(self, seg: Segment, pooled: bool) -> None:
        """Undo :meth:`acquire` after a failed write."""
        if pooled:
            seg.set_state(FREE, seg.state()[1])
        else:
            seg.unmap()
            unlink_quiet(seg.name)

    def close(self) -> None:
        with self._lock:
            segs, self._segments = self._segments, []
        for seg in segs:
            seg.unmap()
            unlink_quiet(seg.name)


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # views still alive somewhere: the GC unmaps it later
        pass


def publish(
    arena: ProducerArena,
    index_name: str,
    frame: codec.Frame,
    inline_below: int,
    *,
    stream: bool = False,
) -> tuple[int, bytes | None]:
    """Write ``frame`` and its index entry; return ``(size, inline_bytes_or_None)``.

    With ``stream`` a pooled segment is published as soon as the frame's header
    is written, and its ``progress`` advances with every packed step. Frames with
    byte blobs are not streamed: decoding copies blobs, so they must be final first.
    """
    size = frame.nbytes
    if size < inline_below:
        blob = frame.to_bytearray()
        _write_index(index_name, b"I" + bytes(blob))
        return size, bytes(blob)
    seg, pooled = arena.acquire(size)
    if stream and pooled and not frame.blobs:
        _publish_streaming(arena, seg, index_name, frame)
        return size, None
    try:
        frame.pack_into(memoryview(seg.mm)[DATA_OFFSET : DATA_OFFSET + size])
        gen = seg.state()[1] + 1
        seg.set_state(PUBLISHED if pooled else ONESHOT, gen)
        _write_index(index_name, _ref_entry(arena, seg, gen, size, pooled, False))
    except BaseException:
        arena.release_unpublished(seg, pooled)
        raise
    if not pooled:
        seg.unmap()  # the reader unlinks a one-shot segment after use
    return size, None


def _ref_entry(
    arena: ProducerArena, seg: Segment, gen: int, size: int, pooled: bool, stream: bool
) -> bytes:
    ref = {"seg": seg.name, "gen": gen, "size": size, "pid": arena.pid, "pooled": pooled}
    return (b"S" if stream else b"R") + msgpack.packb(ref)


def _publish_streaming(
    arena: ProducerArena, seg: Segment, index_name: str, frame: codec.Frame
) -> None:
    size = frame.nbytes
    steps = frame.iter_pack(memoryview(seg.mm)[DATA_OFFSET : DATA_OFFSET + size])
    gen = seg.state()[1] + 1
    published = False
    try:
        head = next(steps)
        seg.set_progress(head)
        seg.set_state(STREAMING, gen)  # readers check the generation, so it goes last
        _write_index(index_name, _ref_entry(arena, seg, gen, size, True, True))
        published = True
        for done in steps:
            seg.set_progress(done)
    except BaseException:
        if published:
            arena.finish_stream(seg, ABORTED, gen)  # a reader that claimed it frees it
        else:
            arena.release_unpublished(seg, True)
        raise
    arena.finish_stream(seg, PUBLISHED, gen)


def _write_index(name: str, content: bytes) -> None:
    tmp = f"{name}.tmp{uuid.uuid4().hex[:12]}"
    fd = _create_file(tmp, 0)
    try:
        os.write(fd, content)
        os.rename(path(tmp), path(name))
    except BaseException as e:
        unlink_quiet(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise _no_room("an index entry", e) from None
        raise
    finally:
        os.close(fd)


def claim_index(name: str) -> bytes | None:
    """Atomically take the index entry ``name``; None when absent."""
    claimed = f"{name}.claim{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path(name), path(claimed))
    except FileNotFoundError:
        return None
    try:
        with open(path(claimed), "rb") as f:
            return f.read()
    finally:
        unlink_quiet(claimed)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def _owner_pid(name: str) -> int | None:
    try:
        if name.startswith(SEG_PREFIX):
            return int(name[len(SEG_PREFIX) :].split("_", 1)[0])
        if ".claim" in name:
            return int(name.split(".claim", 1)[1].split("_", 1)[0])
        if name.startswith(IDX_PREFIX) and ".tmp" not in name:
            with open(path(name), "rb") as f:
                entry = f.read()
            if entry[:1] in (b"R", b"S"):
                return int(msgpack.unpackb(entry[1:])["pid"])
    except (ValueError, KeyError, OSError, TypeError, msgpack.UnpackException):
        return None
    return None


def sweep_orphans() -> list[str]:
    """Unlink arena files whose owning process is gone; return their names."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = _owner_pid(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            if os.stat(path(name)).st_uid != uid:
                continue  # another user's file: not ours to judge or remove
            if unlink_quiet(name):
                removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:  # never fail an engine start over a file we cannot remove
            logger.warning("left orphaned shared-memory file %s in place: %s", path(name), e)
    return removed
