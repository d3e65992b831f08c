"""Persistent shared-memory arena behind :class:`SharedMemoryConnector`.

Allocating tmpfs pages is the dominant cost of a fresh segment (the kernel
zeroes every page), and mapping one costs a page-table walk. So a producer
keeps a few large segments mapped for its whole life and reuses them; a
consumer caches its mappings of them. Files in ``/dev/shm``:

* ``omnikv_seg_<pid>_<id>`` - an arena segment of the producer ``pid``. Its first
  64 bytes are a slot header: ``u32 state | u32 pad | u64 generation``;
  the frame follows at offset 64. States: FREE, PUBLISHED (a reader may claim
  it), ONESHOT (a one-off segment the reader unlinks after use).
* ``omnikv_idx_<digest>`` - the index entry of one key: ``b"R"`` + msgpack
  ``{seg, gen, size, pid}`` pointing into a segment, or ``b"I"`` + an inline
  frame for small payloads. Written under a temporary name then renamed, so
  readers never see half of one; claimed by renaming (one reader wins).

The consumer returns a segment to its producer (state FREE) when the last
tensor view of the decoded object is garbage collected. Files of dead
processes are swept by :func:`sweep_orphans`.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.transfer import codec

SHM_DIR = "/dev/shm"
PREFIX = "omnikv_"
SEG_PREFIX = PREFIX + "seg_"
IDX_PREFIX = PREFIX + "idx_"
SLOT_HEADER = struct.Struct("<IIQ")
DATA_OFFSET = 64
FREE, PUBLISHED, ONESHOT = 0, 1, 2
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def size_class(n: int) -> int:
    """Round ``n`` up so that segments are reusable across similar payloads (<=12.5% slack)."""
    n = max(n, 1 << 20)
    step = 1 << max(n.bit_length() - 4, 12)
    return (n + step - 1) // step * step


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_quiet(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def _create_file(name: str, size: int) -> int:
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        unlink_quiet(name)
        raise
    return fd


@dataclass
class Segment:
    name: str
    capacity: int  # frame bytes it can hold (excludes the slot header)
    mm: mmap.mmap
    last_use: int = 0  # producer-side acquire counter: the highest is the most cache-hot

    def state(self) -> tuple[int, int]:
        st, _pad, gen = SLOT_HEADER.unpack_from(self.mm, 0)
        return st, gen

    def set_state(self, state: int, gen: int) -> None:
        SLOT_HEADER.pack_into(self.mm, 0, state, 0, gen)


class ProducerArena:
    """The segments one producer process owns and reuses."""

    def __init__(self, max_bytes: int, populate: bool = True) -> None:
        self.max_bytes = max_bytes
        self.populate = populate
        self.pid = os.getpid()
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
                if seg.capacity >= nbytes and seg.state()[0] == FREE:
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
        name = f"{SEG_PREFIX}{self.pid}_{uuid.uuid4().hex[:16]}"
        fd = _create_file(name, DATA_OFFSET + capacity)
        try:
            flags = mmap.MAP_SHARED | (_POPULATE if self.populate else 0)
            mm = mmap.mmap(fd, DATA_OFFSET + capacity, flags=flags)
        except BaseException:
            unlink_quiet(name)
            raise
        finally:
            os.close(fd)
        return Segment(name, capacity, mm)

    def release_unpublished(self, seg: Segment, pooled: bool) -> None:
        """Undo :meth:`acquire` after a failed write."""
        if pooled:
            seg.set_state(FREE, seg.state()[1])
        else:
            _close_map(seg.mm)
            unlink_quiet(seg.name)

    def close(self) -> None:
        with self._lock:
            segs, self._segments = self._segments, []
        for seg in segs:
            _close_map(seg.mm)
            unlink_quiet(seg.name)


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # views still alive somewhere: the GC unmaps it later
        pass


def publish(
    arena: ProducerArena, index_name: str, frame: codec.Frame, inline_below: int
) -> tuple[int, bytes | None]:
    """Write ``frame`` and its index entry; return ``(size, inline_bytes_or_None)``."""
    size = frame.nbytes
    if size < inline_below:
        blob = frame.to_bytearray()
        _write_index(index_name, b"I" + bytes(blob))
        return size, bytes(blob)
    seg, pooled = arena.acquire(size)
    try:
        frame.pack_into(memoryview(seg.mm)[DATA_OFFSET : DATA_OFFSET + size])
        gen = seg.state()[1] + 1
        seg.set_state(PUBLISHED if pooled else ONESHOT, gen)
        ref = {"seg": seg.name, "gen": gen, "size": size, "pid": arena.pid, "pooled": pooled}
        _write_index(index_name, b"R" + msgpack.packb(ref))
    except BaseException:
        arena.release_unpublished(seg, pooled)
        raise
    if not pooled:
        _close_map(seg.mm)  # the reader unlinks a one-shot segment after use
    return size, None


def _write_index(name: str, content: bytes) -> None:
    tmp = f"{name}.tmp{uuid.uuid4().hex[:12]}"
    fd = _create_file(tmp, 0)
    try:
        os.write(fd, content)
        os.rename(_path(tmp), _path(name))
    except BaseException:
        unlink_quiet(tmp)
        raise
    finally:
        os.close(fd)


def claim_index(name: str) -> bytes | None:
    """Atomically take the index entry ``name``; None when absent."""
    claimed = f"{name}.claim{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        os.rename(_path(name), _path(claimed))
    except FileNotFoundError:
        return None
    try:
        with open(_path(claimed), "rb") as f:
            return f.read()
    finally:
        unlink_quiet(claimed)


class ConsumerMaps:
    """Mappings of producer segments a consumer has read from, cached by name."""

    def __init__(self, max_maps: int = 64) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()
        self.max_maps = max_maps

    def get(self, name: str) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                self._maps.move_to_end(name)
                return mm
        fd = os.open(_path(name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        with self._lock:
            self._maps[name] = mm
            while len(self._maps) > self.max_maps:
                _n, old = self._maps.popitem(last=False)
                _close_map(old)
        return mm

    def drop(self, name: str) -> None:
        with self._lock:
            mm = self._maps.pop(name, None)
        if mm is not None:
            _close_map(mm)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for mm in maps:
            _close_map(mm)


def read_entry(entry: bytes, maps: ConsumerMaps, verify: bool = True) -> tuple[Any, int]:
    """Decode a claimed index entry; tensors are views of the producer's segment."""
    tag, body = entry[:1], entry[1:]
    if tag == b"I":
        return codec.decode(body, verify=verify), len(body)
    if tag != b"R":
        raise KVPayloadError(f"corrupt shared-memory index entry (tag {tag!r})")
    try:
        ref = msgpack.unpackb(body)
        seg_name, gen, size, pooled = ref["seg"], ref["gen"], ref["size"], ref["pooled"]
    except Exception as e:
        raise KVPayloadError(f"corrupt shared-memory index entry: {e}") from None
    if not (isinstance(seg_name, str) and seg_name.startswith(SEG_PREFIX)):
        raise KVPayloadError(f"shared-memory index points outside the arena: {seg_name!r}")
    try:
        mm = maps.get(seg_name)
    except FileNotFoundError:
        raise KVTransferError(
            f"segment {seg_name} vanished before it was read (its producer exited or was killed)"
        ) from None
    seg = Segment(seg_name, len(mm) - DATA_OFFSET, mm)
    state, seg_gen = seg.state()
    if seg_gen != gen or state not in (PUBLISHED, ONESHOT) or size > seg.capacity:
        _give_back(seg, pooled, maps)
        raise KVPayloadError(
            f"segment {seg_name} does not hold the indexed payload (generation {seg_gen}, "
            f"expected {gen}): it was overwritten or the producer restarted"
        )
    window = np.frombuffer(mm, dtype=np.uint8, count=size, offset=DATA_OFFSET)
    try:
        obj = codec.decode(window, verify=verify)
    except BaseException:
        del window
        _give_back(seg, pooled, maps)
        raise
    # When the last view into `window` is gone, hand the segment back to its producer.
    weakref.finalize(window, _give_back, seg, pooled, maps)
    return obj, size


def _give_back(seg: Segment, pooled: bool, maps: ConsumerMaps) -> None:
    try:
        if pooled:
            seg.set_state(FREE, seg.state()[1])
        else:
            maps.drop(seg.name)
            unlink_quiet(seg.name)
    except (ValueError, OSError):  # mapping already closed at interpreter exit
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    try:
        if name.startswith(SEG_PREFIX):
            return int(name[len(SEG_PREFIX) :].split("_", 1)[0])
        if ".claim" in name:
            return int(name.split(".claim", 1)[1].split("_", 1)[0])
        if name.startswith(IDX_PREFIX) and ".tmp" not in name:
            with open(_path(name), "rb") as f:
                entry = f.read()
            if entry[:1] == b"R":
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
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = _owner_pid(name)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            if unlink_quiet(name):
                removed.append(name)
    return removed
