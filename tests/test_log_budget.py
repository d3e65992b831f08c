"""Lines a client or a peer can cause once per request are budgeted (``LogBudget``): a
flood is held back after a burst, and the next line says how many were."""

from __future__ import annotations

import logging
import time

import pytest

from vllm_omni_kv.logger import LogBudget


def test_a_flood_is_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("vllm_omni_kv.test_budget")
    budget = LogBudget(log, rate=20.0, burst=5)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(10_000):
            budget.warning("request %d refused", i)
        lines = [r.getMessage() for r in caplog.records]
        assert 5 <= len(lines) <= 10  # the burst, and what refilled meanwhile
        assert lines[:5] == [f"request {i} refused" for i in range(5)]
        time.sleep(0.1)  # two tokens refill
        caplog.clear()
        budget.warning("request %d refused", 10_000)
    (last,) = [r.getMessage() for r in caplog.records]
    assert last.startswith("request 10000 refused (and ") and "more like it held back" in last
    held = int(last.split("(and ")[1].split()[0])
    assert held + len(lines) == 10_000
