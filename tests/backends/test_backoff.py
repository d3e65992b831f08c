"""The sleeps of the transports' polling loops: a transfer's end is seen soon after it happens,
at any duration, with few polls on long waits.

Engine-free: the module's clock is a simulated one (each poll takes ``POLL_S``; a sleep
takes exactly what was asked), so the bounds are exact and hold on a loaded machine.
"""

from __future__ import annotations

import math

import pytest

from vllm_omni_kv.backends import backoff

POLL_S = 2e-6


class Clock:
    """Simulated ``time`` and ``os`` for the module: sleeping and yielding advance it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds + POLL_S

    def sched_yield(self) -> None:
        self.now += POLL_S


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(backoff, "time", c)
    monkeypatch.setattr(backoff, "os", c, raising=False)
    return c


def _wait(clock: Clock, b: backoff.Backoff, ends_after: float) -> tuple[float, int]:
    """Poll until ``ends_after`` seconds have passed; (how late the end was seen, polls)."""
    end, polls = clock.now + ends_after, 0
    while clock.now < end:
        b.sleep()
        polls += 1
    return clock.now - end, polls


DURATIONS = [1e-6 * 1.07**i for i in range(0, 260, 3)]  # 1 µs .. ~40 s


def test_the_end_of_a_wait_is_seen_at_most_a_sixteenth_of_it_late(clock: Clock) -> None:
    """A transfer of 0.1 ms or 1 ms is seen within a sixteenth of its duration (plus a
    poll), so a poll never costs a short transfer most of its speed."""
    for t in DURATIONS:
        late, _ = _wait(clock, backoff.Backoff(), t)
        assert late <= t / 16 + POLL_S, f"{t * 1e3:.3f} ms wait seen {late * 1e6:.1f} us late"


def test_long_waits_poll_rarely(clock: Clock) -> None:
    """Past the first half millisecond, polls grow with the logarithm of the wait until
    they are a millisecond apart: a 10 s wait polls about 10,000 times, not millions."""
    spin = backoff.SPIN_S / POLL_S + 1
    for t in (1e-3, 1e-2, 1.0, 10.0):
        _, polls = _wait(clock, backoff.Backoff(), t)
        ramp = math.log(t / backoff.SPIN_S) * 17 if t > backoff.SPIN_S else 0
        assert polls <= spin + ramp + t / backoff.MAX_POLL_S, (t, polls)


def test_reset_starts_the_polls_quick_again(clock: Clock) -> None:
    """After a long wait, :meth:`~backoff.Backoff.reset` makes the next short wait quick."""
    b = backoff.Backoff()
    _wait(clock, b, 5.0)
    b.reset()
    late, _ = _wait(clock, b, 1e-4)
    assert late <= POLL_S
