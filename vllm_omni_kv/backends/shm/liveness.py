"""Liveness of shared-memory owners: by pid in our PID namespace, by heartbeat across.

A segment header (see :mod:`vllm_omni_kv.backends.shm.arena`) carries, besides the slot
state, four words: ``owner`` (a random per-process instance id), ``beat`` (the owner's
last heartbeat, ``CLOCK_BOOTTIME`` milliseconds, rewritten every :data:`HEARTBEAT_S` by
a producer thread), ``ident`` (word 6: who the owner is, :func:`owner_ident`) and
``reader`` (the lease of the reader holding the segment: the generation's low 16 bits
over its own 48-bit beat).

``ident`` layout 1: bits 62-63 the layout (``01``), bits 32-61 the owner's start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot, low 30 bits), bits 0-31 its PID
namespace (the inode of ``/proc/self/ns/pid``, folded to 32 bits). Layout 0 (files of
older versions): the whole word is the namespace inode. Other layouts: unknown, so
foreign. An owner whose ``ident`` names our PID namespace is alive exactly while its pid
exists with that start time (a reused pid starts later; a stopped or starved process is
alive); its heartbeat is not read. Any other owner is judged by its heartbeat alone,
dead once it is older than the staleness (``heartbeat_stale_s``, default
:data:`STALE_S`). ``CLOCK_BOOTTIME`` is one clock for every container of a host unless
they run in time namespaces with different offsets (not supported).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Sequence

W_OWNER, W_BEAT, W_PIDNS, W_READER = 4, 5, 6, 7
#: how often a producer rewrites its heartbeat and a reader its lease (seconds)
HEARTBEAT_S = 1.0
#: default age (seconds) after which a heartbeat from another PID namespace, or a reader
#: lease, counts as dead: far above any stall a live process's thread meets by accident
#: (a starved CPU, a debugger, a frozen container)
STALE_S = 120.0
#: ``ident`` layout written by this version
IDENT_LAYOUT = 1
_LAYOUT_SHIFT, _START_SHIFT = 62, 32
_START_MASK, _NS_MASK = (1 << 30) - 1, (1 << 32) - 1
_BEAT_MASK = (1 << 48) - 1
#: the kernel's largest pid (PID_MAX_LIMIT): a pid outside 1..PID_MAX is no process
PID_MAX = 1 << 22


def now_ms() -> int:
    """``CLOCK_BOOTTIME`` in milliseconds."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


_pidns_cache: tuple[int, int] = (-1, 0)
_ident_cache: tuple[int, int] = (-1, 0)


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 when ``/proc`` cannot tell)."""
    global _pidns_cache
    pid = os.getpid()
    if _pidns_cache[0] != pid:
        try:
            ino = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ino = 0
        _pidns_cache = (pid, ino)
    return _pidns_cache[1]


def _fold(ino: int) -> int:
    return (ino ^ (ino >> 32)) & _NS_MASK


def owner_ident() -> int:
    """The ``ident`` word of the headers (and inline entries) this process writes: layout 1
    with its start time and PID namespace; layout 0 (the namespace inode) when ``/proc``
    cannot tell the start time."""
    global _ident_cache
    pid = os.getpid()
    if _ident_cache[0] != pid:
        ns, start = pid_namespace(), process_start(pid)
        if ns and start is not None and start >= 0:
            word = IDENT_LAYOUT << _LAYOUT_SHIFT
            word |= (start & _START_MASK) << _START_SHIFT | _fold(ns)
        else:
            word = ns
        _ident_cache = (pid, word)
    return _ident_cache[1]


def in_our_namespace(ident: int) -> bool:
    """Whether the owner that wrote ``ident`` runs in this process's PID namespace."""
    ns = pid_namespace()
    if not ns:
        return False
    layout = ident >> _LAYOUT_SHIFT
    if layout == IDENT_LAYOUT:
        return ident & _NS_MASK == _fold(ns)
    return layout == 0 and ident == ns


def local_verdict(ident: int, pid: int | None) -> bool | None:
    """Whether owner ``pid`` that wrote ``ident`` is alive, where ``ident`` puts it in our
    PID namespace (layout 1: the pid exists with the recorded start time; layout 0: the
    pid exists); None where the pid cannot tell (another namespace, an unknown layout, no
    pid or one no process can have)."""
    if pid is None or not 0 < pid <= PID_MAX or not in_our_namespace(ident):
        return None
    if ident >> _LAYOUT_SHIFT == 0:
        return pid_alive(pid)
    if _PIDFDS.running(pid, ident):
        return True
    started = process_start(pid)
    if started is None:
        return False
    alive = started < 0 or started & _START_MASK == (ident >> _START_SHIFT) & _START_MASK
    if alive and started >= 0:
        _PIDFDS.remember(pid, ident)
    return alive


class _PidFds:
    """pidfds of owners found alive, so that the next check is one ``poll`` (about 1 µs)
    instead of a read of ``/proc/<pid>/stat``. A pidfd refers to one process, never to a
    later one with its pid. Only "still running" is taken from it: anything else (it
    exited, the descriptor was closed under us) falls back to ``/proc``."""

    MAX = 64

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], tuple[int, select.poll, tuple[int, int]]] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def running(self, pid: int, ident: int) -> bool:
        with self._lock:
            if self._pid != os.getpid():  # forked: the descriptors are the parent's
                self._fds, self._pid = {}, os.getpid()
            got = self._fds.get((pid, ident))
            if got is None:
                return False
            if not got[1].poll(0):
                return True
            del self._fds[(pid, ident)]
        _close_if(got[0], got[2])
        return False

    def remember(self, pid: int, ident: int) -> None:
        """Keep a pidfd of ``pid``, just found running with the start time in ``ident``."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here (old kernel, seccomp): /proc only
            return
        started = process_start(pid)  # the pidfd is of the process checked, not a successor
        if started is None or started & _START_MASK != (ident >> _START_SHIFT) & _START_MASK:
            os.close(fd)
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        st = os.fstat(fd)
        with self._lock:
            old = self._fds.pop((pid, ident), None)
            self._fds[(pid, ident)] = (fd, poller, (st.st_dev, st.st_ino))
            evicted = [old] if old is not None else []
            while len(self._fds) > self.MAX:
                evicted.append(self._fds.pop(next(iter(self._fds))))
        for e in evicted:
            _close_if(e[0], e[2])


def _close_if(fd: int, ident: tuple[int, int]) -> None:
    """Close ``fd`` only while it is still the file ``ident`` (device, inode) opened as: a
    descriptor someone else closed and reused is not ours to close."""
    try:
        st = os.fstat(fd)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == ident:
        os.close(fd)


_PIDFDS = _PidFds()


def lease_word(gen: int, ms: int) -> int:
    """A reader's lease on generation ``gen`` of a segment, renewed at ``ms``."""
    return ((gen & 0xFFFF) << 48) | (ms & _BEAT_MASK)


def lease_of(word: int, gen: int) -> int | None:
    """The renewal time (ms) of a reader lease on generation ``gen``; None when there is none."""
    if word == 0 or word >> 48 != gen & 0xFFFF:
        return None
    return word & _BEAT_MASK


def owner_alive(words: Sequence[int], pid: int | None, stale_s: float = STALE_S) -> bool:
    """Whether the producer behind a segment header ``words`` (``pid``: from the file's
    name or index entry) is alive, by the rules in the module docstring. A layout-0 header
    keeps the rules of the version that wrote it: dead once its beat is ``stale_s`` old,
    or, in our PID namespace, once its pid is gone; without a beat, its pid alone."""
    if len(words) <= W_READER:
        return False
    ident, beat = int(words[W_PIDNS]), int(words[W_BEAT])
    fresh = beat != 0 and now_ms() - beat <= stale_s * 1000
    if ident >> _LAYOUT_SHIFT == 0:
        if beat == 0:
            return pid is None or pid_alive(pid)
        verdict = local_verdict(ident, pid) if fresh else False
    else:
        verdict = local_verdict(ident, pid)
    return fresh if verdict is None else verdict


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid``; None when there is no
    such process (or it exited and awaits its reaper); -1 when it exists but ``/proc``
    cannot tell."""
    if not 0 < pid <= PID_MAX:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError:
        return -1 if pid_alive(pid) else None
    fields = raw.rpartition(b")")[2].split()
    if len(fields) < 20 or not fields[19].isdigit():
        return -1  # unreadable: alive, as kill() would say
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    if not 0 < pid <= PID_MAX:
        return False
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
