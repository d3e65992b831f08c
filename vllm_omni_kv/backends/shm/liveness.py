"""Liveness of shared-memory owners across PID namespaces: heartbeats and reader leases.

A segment header (see :mod:`vllm_omni_kv.backends.shm.arena`) carries, besides the slot
state, four words: ``owner`` (a random per-process instance id, so a reused pid cannot
pass for its predecessor), ``beat`` (the owner's last heartbeat, ``CLOCK_BOOTTIME``
milliseconds, rewritten every :data:`HEARTBEAT_S` by a producer thread), ``pidns`` (the
inode of the owner's PID namespace) and ``reader`` (the lease of the reader holding the
segment: the generation's low 16 bits over its own 48-bit beat). ``CLOCK_BOOTTIME`` is
one clock for every container of a host unless they run in time namespaces with
different offsets (not supported), and it never steps back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

W_OWNER, W_BEAT, W_PIDNS, W_READER = 4, 5, 6, 7
#: how often a producer rewrites its heartbeat and a reader its lease (seconds)
HEARTBEAT_S = 1.0
#: default age (seconds) after which a heartbeat or reader lease counts as dead
STALE_S = 10.0
_BEAT_MASK = (1 << 48) - 1


def now_ms() -> int:
    """``CLOCK_BOOTTIME`` in milliseconds."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


_pidns_cache: tuple[int, int] = (-1, 0)


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


def lease_word(gen: int, ms: int) -> int:
    """A reader's lease on generation ``gen`` of a segment, renewed at ``ms``."""
    return ((gen & 0xFFFF) << 48) | (ms & _BEAT_MASK)


def lease_of(word: int, gen: int) -> int | None:
    """The renewal time (ms) of a reader lease on generation ``gen``; None when there is none."""
    if word == 0 or word >> 48 != gen & 0xFFFF:
        return None
    return word & _BEAT_MASK


def owner_alive(words: Sequence[int], pid: int | None, stale_s: float = STALE_S) -> bool:
    """Whether the producer behind a segment header ``words`` is alive.

    A beat older than ``stale_s`` is dead in any PID namespace. When the owner shares our
    PID namespace its pid is meaningful here, so a vanished pid is dead at once (no wait);
    across namespaces the pid says nothing and only the beat counts. Without a beat (a
    file of an older version) the pid is all there is.
    """
    beat = int(words[W_BEAT])
    if beat == 0:
        return pid is None or pid_alive(pid)
    if now_ms() - beat > stale_s * 1000:
        return False
    ns = int(words[W_PIDNS])
    if pid is not None and ns and ns == pid_namespace():
        return pid_alive(pid)
    return True


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
