"""The sleeps of NIXL's polling loops (transfer states, notifications): none at first, then
50 µs longer each round up to :data:`MAX_POLL_S`, so that a short transfer is seen at once
and a long one costs little CPU."""

from __future__ import annotations

import time

#: the longest sleep between two polls (seconds)
MAX_POLL_S = 0.001
#: how much longer each sleep is than the one before (seconds)
STEP_S = 0.00005


class Backoff:
    """The growing sleep of one polling loop."""

    def __init__(self) -> None:
        self.delay = 0.0

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(MAX_POLL_S, self.delay + STEP_S)

    def reset(self) -> None:
        """Start again from no sleep (the loop found new work)."""
        self.delay = 0.0
