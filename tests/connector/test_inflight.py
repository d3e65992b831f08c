"""The worker's load threads and its notice thread (:mod:`.inflight`, :mod:`.notices`),
with real threads: notices to a silent producer never delay a load, never queue without
bound, and neither they nor a load waiting on a paused producer hold shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_omni_kv.connector import notices as notices_mod
from vllm_omni_kv.connector.inflight import InflightLoads
from vllm_omni_kv.connector.notices import Notices
from vllm_omni_kv.connector.outcome import Outcome


def _outcome(req_id: str, ok: bool = True, error: str = "") -> Outcome:
    return Outcome(req_id=req_id, block_ids=[], ok=ok, error=error)


def test_a_silent_producers_notices_do_not_delay_loads() -> None:
    """A notice that waits out a paused producer's timeout holds the notice thread only:
    a load submitted after it lands at once."""
    silent, sent = threading.Event(), threading.Event()
    notices, loads = Notices(), InflightLoads(1)
    try:
        assert notices.submit("extend", "r0", "p", lambda: silent.wait(10))
        assert notices.submit("discard", "r1", "q", sent.set)  # queued behind it
        loads.start("r2", lambda cancel: _outcome("r2"), lambda why: _outcome("r2", False, why))
        loads.wait(lambda running: bool(running), 5)
        assert [o.req_id for o in loads.take()] == ["r2"]
        assert not sent.is_set()
    finally:
        silent.set()
        notices.close()
        loads.stop(lambda: None, 5, 5)


def test_notices_are_bounded_and_not_queued_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notices_mod, "MAX_WAITING", 3)
    silent = threading.Event()
    ran: list[str] = []
    notices = Notices()
    try:
        assert notices.submit("extend", "busy", "p", lambda: silent.wait(10))
        time.sleep(0.2)  # it runs: the queue is empty again
        got = [
            notices.submit("extend", f"r{i}", "q", lambda i=i: ran.append(f"r{i}"))
            for i in range(5)
        ]
        assert got == [True, True, True, False, False] and notices.dropped == 2
        assert notices.submit("extend", "r0", "q", lambda: ran.append("again")) is False  # waits
        silent.set()
        deadline = time.monotonic() + 5
        while len(ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["r0", "r1", "r2"]
        assert notices.submit("extend", "r0", "q", lambda: ran.append("r0 again")) is True
    finally:
        silent.set()
        notices.close()


def test_closing_waits_for_no_silent_producer() -> None:
    silent = threading.Event()
    notices = Notices()
    notices.submit("discard", "r", "p", lambda: silent.wait(30))
    t0 = time.monotonic()
    notices.close()
    assert time.monotonic() - t0 < 1
    assert notices.submit("discard", "r2", "p", lambda: None) is False
    silent.set()


def test_shutdown_ends_a_load_waiting_on_a_paused_producer() -> None:
    """A cancelled load that still waits on its transfers (a paused producer) ends once the
    backend's transfers are ended, which shutdown does after a bounded wait, not never."""
    transfers_end = threading.Event()
    loads = InflightLoads(2)

    def stuck(cancel: threading.Event) -> Outcome:
        transfers_end.wait(60)  # ignores cancel, as a drain of abandoned reads does
        return _outcome("r", False, "cancelled")

    loads.start("r", stuck, lambda why: _outcome("r", False, why))
    t0 = time.monotonic()
    loads.stop(transfers_end.set, 0.5, 5)
    assert time.monotonic() - t0 < 5
    assert loads.running() == set()
    assert [o.req_id for o in loads.take()] == ["r"]


def test_cancel_wait_and_relabel() -> None:
    gate = threading.Event()
    loads = InflightLoads(2)
    seen: list[bool] = []

    def load(cancel: threading.Event) -> Outcome:
        gate.wait(10)
        seen.append(cancel.is_set())
        return _outcome("a")

    loads.start("a", load, lambda why: _outcome("a", False, why))
    assert loads.running() == {"a"}
    assert loads.cancel({"a", "b"}) == {"a"}
    gate.set()
    loads.wait(lambda running: "a" in running, 5)
    assert seen == [True]
    assert loads.relabel(lambda o: _outcome(o.req_id, False, "lost")) == {"a"}
    assert [(o.req_id, o.ok, o.error) for o in loads.take()] == [("a", False, "lost")]
    assert loads.take() == []
    loads.stop(lambda: None, 1, 1)


def test_a_silent_producer_gets_no_notice_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notice that took over SLOW_S (a paused producer) keeps that producer's next
    notices off the thread for QUIET_S, so those to other producers go out at once."""
    monkeypatch.setattr(notices_mod, "SLOW_S", 0.1)
    monkeypatch.setattr(notices_mod, "QUIET_S", 60.0)
    ran: list[str] = []
    notices = Notices()
    try:
        slow = threading.Event()
        assert notices.submit("extend", "r0", "paused", lambda: (time.sleep(0.3), slow.set()))
        assert slow.wait(5)
        time.sleep(0.1)  # the thread notes how long it took
        assert notices.submit("discard", "r1", "paused", lambda: ran.append("paused")) is False
        assert notices.dropped == 1
        assert notices.submit("discard", "r2", "healthy", lambda: ran.append("healthy"))
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["healthy"]
    finally:
        notices.close()
