"""A failed ``register_cache`` copy (:class:`~vllm_omni_kv.backends.pull.page_pull.PagePull`)
returns only once no read it issued can write into the consumer's KV cache: its load is
reported failed then, and vLLM reuses those pages. A read given up on completes its
future only when its transfer ended (a NIXL transfer over TCP lands bytes after it was
released, ``tests/backends/nixl/test_late_bytes.py``); here that future is completed by
hand, past several of the drain's log intervals."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time

import pytest

from vllm_omni_kv.backends.pull import page_pull
from vllm_omni_kv.backends.pull.page_pull import PagePull


def test_a_failed_copy_waits_for_a_read_still_running_however_long(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(page_pull, "DRAIN_S", 0.05)
    pull = PagePull(None, "peer", time.monotonic())  # type: ignore[arg-type]
    running: cf.Future[None] = cf.Future()
    pull.reads += [cf.Future(), running]
    pull.reads[0].set_result(None)  # a read that ended
    threading.Timer(0.4, running.set_result, (None,)).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        pull.drain()
    assert time.monotonic() - t0 >= 0.35, "the copy returned while a read could still land"
    assert running.done()
    assert "still runs" in caplog.text
