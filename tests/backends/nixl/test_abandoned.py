"""Transfers given up on (:class:`~vllm_omni_kv.backends.nixl.abandoned.Abandoned`),
engine-free: a transfer that keeps moving bytes after it was released (UCX over TCP does;
shown with real agents in ``test_nixl.py``) is polled to its end, released once after it,
and its future completes only then.

The handles are stand-ins (:class:`.fake_transfers.TimedHandle`).
"""

from __future__ import annotations

import time

from vllm_omni_kv.backends.nixl.abandoned import Abandoned

from .fake_transfers import TimedHandle


def _state(h: TimedHandle) -> str:
    if h.releases:
        raise AssertionError("checked after its release")
    return h.state()


def test_a_transfer_is_released_once_after_it_ends_and_only_then_its_future_completes() -> None:
    abandoned = Abandoned(_state)  # type: ignore[arg-type]
    try:
        now = time.monotonic()
        handles = [TimedHandle(now + 0.3), TimedHandle(now + 0.1, "ERR"), TimedHandle(now)]
        futures = [abandoned.add(h, "peer", f"transfer {i}") for i, h in enumerate(handles)]
        time.sleep(0.05)
        assert [f.done() for f in futures] == [False, False, True]
        assert abandoned.holds("peer") and not abandoned.holds("other")
        assert all(f.result(timeout=5) is None for f in futures)
        for h in handles:
            assert h.releases == 1 and not h.released_running
        assert len(abandoned) == 0
    finally:
        abandoned.close()


def test_close_completes_the_futures_of_transfers_still_running() -> None:
    """The agent goes with ``close`` (its transports stop), so nothing can land any more."""
    abandoned = Abandoned(_state)  # type: ignore[arg-type]
    running = abandoned.add(TimedHandle(time.monotonic() + 3600), "peer", "a stuck transfer")
    time.sleep(0.05)
    assert not running.done()
    abandoned.close()
    assert running.done()
    assert abandoned.add(TimedHandle(time.monotonic() + 3600), "peer", "after close").done()
