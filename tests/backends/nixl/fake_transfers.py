"""A stand-in for a NIXL transfer handle whose state changes at a set time, which a real
transfer cannot be made to show on demand."""

from __future__ import annotations

import time


class TimedHandle:
    """A transfer that runs (``PROC``) until ``ends_at`` (monotonic), then is ``end``;
    notes each release, and a release while it still ran."""

    def __init__(self, ends_at: float = float("inf"), end: str = "DONE", pause_s: float = 0.0):
        self.releases, self.ends_at, self.end, self.pause_s = 0, ends_at, end, pause_s
        self.released_running = False

    def state(self) -> str:
        return "PROC" if time.monotonic() < self.ends_at else self.end

    def release(self) -> None:
        self.releases += 1
        self.released_running |= self.state() == "PROC"
        time.sleep(self.pause_s)
