"""Pausing a process in a test, and knowing it is paused.

``kill(pid, SIGSTOP)`` returns before the process stops: the signal goes to one of its
threads, which stops the others when it next runs. Until then the rest of the process runs
on; on a busy machine long enough for a server thread to take a request sent right after
the ``kill``, post a transfer and send its notification, and only then stop (seen with a
NIXL producer asked to WRITE: the "paused" producer's write ended and the consumer rightly
freed the memory it targeted). :func:`pause` returns once every thread is stopped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _state(stat: Path) -> str | None:
    """The state letter of a ``/proc/.../stat`` file (None: gone meanwhile)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _members(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            out.append(int(stat.parent.name))
    return out


def stopped(pid: int) -> bool:
    """Whether no thread of ``pid`` can run: each is stopped (``T``), or gone or a zombie
    (a process that exited meanwhile never runs again either)."""
    states = [_state(s) for s in Path(f"/proc/{pid}/task").glob("*/stat")]
    return all(s in (None, "T", "t", "Z", "X") for s in states)


def pause(pid: int, *, group: bool = False, timeout: float = 20.0) -> None:
    """SIGSTOP ``pid`` (with ``group``, its whole process group) and return once every
    thread of it (of every process in the group) is stopped."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(stopped(p) for p in (_members(pid) if group else [pid])):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout:g}s of SIGSTOP")
        time.sleep(0.002)
