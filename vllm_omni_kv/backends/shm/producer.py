"""The producing side of the shared-memory backend: the arena of segments one process owns,
its heartbeat, and publishing frames into it (file layout: :mod:`.arena`; liveness:
:mod:`.liveness`)."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import uuid

import msgpack
import numpy as np

from vllm_omni_kv.backends.shm.arena import (
    ABORTED,
    DATA_OFFSET,
    FREE,
    ONESHOT,
    POPULATE,
    PUBLISHED,
    SEG_PREFIX,
    SLOT_WORDS,
    STREAMING,
    Segment,
    _create_file,
    _no_room,
    namespace_tag,
    path,
    size_class,
    unlink_quiet,
)
from vllm_omni_kv.backends.shm.entry_files import inline_entry
from vllm_omni_kv.backends.shm.liveness import (
    HEARTBEAT_S,
    STALE_S,
    W_BEAT,
    W_OWNER,
    W_PIDNS,
    W_READER,
    lease_of,
    now_ms,
    owner_ident,
)
from vllm_omni_kv.backends.shm.pinned_map import PinnedMap
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec

logger = init_logger(__name__)


class ProducerArena:
    """The segments one producer process owns and reuses, kept alive by a heartbeat thread
    that also takes back segments whose reader died after claiming them."""

    def __init__(
        self,
        max_bytes: int,
        populate: bool = True,
        namespace: str = "default",
        stale_s: float = STALE_S,
    ) -> None:
        self.max_bytes = max_bytes
        self.populate = populate
        self.pid = os.getpid()
        self.tag = namespace_tag(namespace)
        self.stale_s = stale_s
        self.instance = int.from_bytes(os.urandom(8), "little") | 1
        self.reclaimed = 0  # claimed segments taken back from dead readers
        self._segments: list[Segment] = []
        self._oneshots: dict[str, Segment] = {}  # published one-off segments not yet unlinked
        self._adopted: list[Segment] = []  # segments kept alive by the heartbeat, never reused
        self._uses = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

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
                best.index = best.claimed_at = None
                return best, True
            cap = size_class(nbytes)
            pooled = self.total_bytes + cap <= self.max_bytes
            seg = self._new_segment(cap if pooled else nbytes, pin=pooled)
            seg.set_state(ONESHOT, 0)
            seg.last_use = self._uses
            if pooled:
                self._segments.append(seg)
        self._start_beating()
        return seg, pooled

    def _new_segment(self, capacity: int, pin: bool = True) -> Segment:
        """A new segment; ``pin``: have it registered with CUDA in the background (pooled
        segments, reused for the process's life: registering costs about 0.6 s per GiB, too
        much for a one-shot; ``put`` never waits for it)."""
        name = f"{SEG_PREFIX}{self.pid}_{self.tag}_{uuid.uuid4().hex[:16]}"
        head = np.zeros(SLOT_WORDS, dtype="<u8")
        head[[W_OWNER, W_BEAT, W_PIDNS]] = (self.instance, now_ms(), owner_ident())
        fd = _create_file(name, DATA_OFFSET + capacity, head.tobytes())
        try:
            flags = mmap.MAP_SHARED | (POPULATE if self.populate else 0)
            mm = PinnedMap(fd, DATA_OFFSET + capacity, flags=flags)
        except BaseException:
            unlink_quiet(name)
            raise
        finally:
            os.close(fd)
        if pin:
            mm.pin_later()
        return Segment(name, capacity, mm)

    def published(self, seg: Segment, pooled: bool, index_name: str) -> None:
        """Record that ``seg`` is about to be published under ``index_name``."""
        seg.index, seg.claimed_at = index_name, None
        if not pooled:
            with self._lock:
                self._oneshots[seg.name] = seg  # beats until its reader unlinks it

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
            with self._lock:
                self._oneshots.pop(seg.name, None)
            seg.unmap()
            unlink_quiet(seg.name)

    def adopt(self, seg: Segment) -> None:
        """Beat ``seg`` (created by this process with its header) until :meth:`close`,
        which unlinks it; the arena never hands it out."""
        with self._lock:
            self._adopted.append(seg)
        self._start_beating()

    # -- heartbeat and reader leases -----------------------------------------------------
    def _start_beating(self) -> None:
        with self._lock:
            if self._beater is not None or self._stop.is_set():
                return
            self._beater = threading.Thread(
                target=self._beat_loop, name="omnikv-shm-heartbeat", daemon=True
            )
            self._beater.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except Exception as e:  # never let the heartbeat die silently
                logger.warning("shared-memory heartbeat: %s", e)

    def beat(self) -> None:
        """Renew this producer's heartbeat; take back segments whose reader died."""
        ms = now_ms()
        with self._lock:
            pooled = list(self._segments)
            shots = list(self._oneshots.values())
            adopted = list(self._adopted)
        for seg in pooled + shots + adopted:
            seg.words()[W_BEAT] = ms
        for seg in pooled:
            if self._reader_died(seg, (PUBLISHED, ABORTED)):
                with self._lock:
                    st, gen = seg.state()
                    if st in (PUBLISHED, ABORTED) and seg.index is not None:
                        seg.set_state(FREE, gen)
                        seg.index = None
                        self.reclaimed += 1
                        logger.warning(
                            "took back shared-memory segment %s: its reader died after claiming "
                            "it (no lease renewal for %.0fs)",
                            seg.name,
                            self.stale_s,
                        )
        for seg in shots:
            if not os.path.exists(path(seg.name)):  # its reader is done with it
                self._drop_oneshot(seg)
            elif self._reader_died(seg, (ONESHOT,)):
                self._drop_oneshot(seg)
                unlink_quiet(seg.name)
                self.reclaimed += 1
                logger.warning(
                    "removed one-off shared-memory segment %s: its reader died after claiming it",
                    seg.name,
                )

    def _drop_oneshot(self, seg: Segment) -> None:
        with self._lock:
            self._oneshots.pop(seg.name, None)
        seg.unmap()

    def _reader_died(self, seg: Segment, states: tuple[int, ...]) -> bool:
        """True for a claimed segment whose reader lease is stale, or that was claimed
        ``stale_s`` ago without a lease ever written (the reader died right after)."""
        index = seg.index
        st, gen, _progress, abandoned = seg.full_state()
        if index is None or st not in states or abandoned == gen:
            return False
        if os.path.exists(path(index)):
            seg.claimed_at = None  # not claimed yet: the payload lease governs it
            return False
        renewed = lease_of(int(seg.words()[W_READER]), gen)
        if renewed is not None:
            return now_ms() - renewed > self.stale_s * 1000
        now = time.monotonic()
        if seg.claimed_at is None:
            seg.claimed_at = now
            return False
        return now - seg.claimed_at > self.stale_s

    def close(self) -> None:
        self._stop.set()
        beater = self._beater
        if beater is not None and beater is not threading.current_thread():
            beater.join(timeout=5.0)
        with self._lock:
            segs, self._segments = self._segments, []
            shots, self._oneshots = list(self._oneshots.values()), {}
            adopted, self._adopted = self._adopted, []
        for seg in segs + shots + adopted:
            seg.unmap()
            unlink_quiet(seg.name)


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
        _write_index(index_name, inline_entry(blob))
        return size, bytes(blob)
    seg, pooled = arena.acquire(size)
    if stream and pooled and not frame.blobs:
        _publish_streaming(arena, seg, index_name, frame)
        return size, None
    try:
        frame.pack_into(memoryview(seg.mm)[DATA_OFFSET : DATA_OFFSET + size])
        gen = seg.state()[1] + 1
        arena.published(seg, pooled, index_name)  # the reader unlinks a one-shot segment
        seg.set_state(PUBLISHED if pooled else ONESHOT, gen)
        _write_index(index_name, _ref_entry(arena, seg, gen, size, pooled, False))
    except BaseException:
        arena.release_unpublished(seg, pooled)
        raise
    return size, None


def _ref_entry(
    arena: ProducerArena, seg: Segment, gen: int, size: int, pooled: bool, stream: bool
) -> bytes:
    ref = {
        "seg": seg.name,
        "gen": gen,
        "size": size,
        "pid": arena.pid,
        "pooled": pooled,
        "owner": arena.instance,
    }
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
        arena.published(seg, True, index_name)
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
