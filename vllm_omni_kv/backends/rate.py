"""A token bucket: how often a server does something a peer asks for (side-channel
requests, NIXL metadata loads)."""

from __future__ import annotations

import time


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` kept (full at start). One owner: its
    callers serialize the calls (a serving thread, or the caller's lock)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self._tokens, self._refilled = self.burst, time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now

    def take(self) -> bool:
        """Take one token if there is one."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def charge(self) -> None:
        """Take one token, or what is left of one (a refused request still costs)."""
        self._refill()
        self._tokens = max(0.0, self._tokens - 1)
