"""The sleeps of the transports' polling loops (NIXL's transfer states and notifications,
Mooncake's reads of a few ranges).

A loop polls without sleeping for its first :data:`SPIN_S` (it yields the core and the
GIL between polls: ``sched_yield``, where even ``time.sleep(0)`` takes the OS's sleep
granularity), so that a short transfer is seen at once; after that each sleep is
:data:`LATE_FRACTION` of the time waited so far, up to :data:`MAX_POLL_S`. A transfer's
end is then seen at most that fraction of its duration late (plus the OS's sleep
granularity, about 60 µs on Linux), at a number of polls that grows with the logarithm of
the wait, and the poller leaves the cores to the threads that move the bytes.
"""

from __future__ import annotations

import os
import time

#: polls in the first this many seconds of a wait do not sleep
SPIN_S = 0.0005
#: each later sleep, as a fraction of the time waited so far
LATE_FRACTION = 1 / 16
#: the longest sleep between two polls (seconds)
MAX_POLL_S = 0.001


class Backoff:
    """The sleeps of one polling loop, from its start or its last :meth:`reset`."""

    def __init__(self) -> None:
        self._since = time.monotonic()

    def sleep(self) -> None:
        waited = time.monotonic() - self._since
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(min(MAX_POLL_S, waited * LATE_FRACTION))

    def reset(self) -> None:
        """Start again from no sleep (the loop found new work)."""
        self._since = time.monotonic()
