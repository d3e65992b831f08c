"""CPU placement of the connector's background threads inside vLLM workers.

vLLM's CPU worker pins its main thread (which busy-waits for the next step) to
one core, and every thread created afterwards inherits that pin: the backend's
threads (our side channel, the transfer engine's I/O threads) would share one
core with a spinning thread, and a peer waits on them for seconds. The worker
creates its backend inside :func:`spawn_on`, so those threads start on the CPUs
the process had before vLLM pinned it. Load threads stay on the pinned core.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)


def parse_cpu_list(spec: str) -> set[int]:
    """``"0-3,8"`` -> ``{0, 1, 2, 3, 8}``; raises ``ValueError`` on bad input."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi) if hi else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {spec!r}")
    return cpus


def describe(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def background_cpus(setting: str = "auto") -> set[int] | None:
    """The CPUs for background threads: None leaves threads where they are.

    ``auto``: this thread's CPUs plus those of the parent process (vLLM's engine
    core, not pinned); ``inherit``: None; otherwise a CPU list like ``"0-3,8"``.
    """
    if setting == "inherit" or not hasattr(os, "sched_getaffinity"):
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    mine = os.sched_getaffinity(0)
    try:
        parent = os.sched_getaffinity(os.getppid())
    except OSError:
        parent = set()
    wide = mine | parent
    return wide if wide != mine else None


def apply_to_current_thread(cpus: set[int] | None) -> None:
    """Move the calling thread to ``cpus`` (None: leave it where it is)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        logger.warning("could not place a transfer thread on CPUs %s: %s", sorted(cpus), e)


@contextlib.contextmanager
def spawn_on(cpus: set[int] | None) -> Iterator[None]:
    """Threads started inside this block (Python or native) begin on ``cpus``."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    apply_to_current_thread(cpus)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)
