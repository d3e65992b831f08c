"""A paused ``mooncake_master`` (SIGSTOP: its port still accepts connections, nothing
answers) against a real store client: the first store call blocks for the client's RPC
timeout and returns RPC_TIMEOUT (-901); from then on puts, session sends, cleanups, gets
and discards fail at once until the master answers again (SIGCONT), when a round trip
goes through and the keys whose cleanup was skipped are removed.

The client's RPC timeout is ``MC_RPC_TIMEOUT_MS`` (30 s by default), set to 3 s here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from _pause import pause

from vllm_omni_kv.backends.keys import edge_key
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.transfer.session import TransferSession

pytestmark = [pytest.mark.mooncake, pytest.mark.slow]

pytest.importorskip("mooncake.store", reason="the Mooncake store is not installed")

from vllm_omni_kv.backends.mooncake_store.connector import MooncakeStoreConnector  # noqa: E402
from vllm_omni_kv.backends.mooncake_store.master import (  # noqa: E402
    MasterHandle,
    mooncake_master,
)

RPC_TIMEOUT_S = 3.0
#: a call that must not reach the master (2 shared cores)
FAST_S = 2.0


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MasterHandle, MooncakeStoreConnector]]:
    """A master and a connector whose store client times out RPCs after 3 s."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", str(int(RPC_TIMEOUT_S * 1000)))
    with mooncake_master() as m:
        c = MooncakeStoreConnector(m.store_config(connect_timeout_s=5.0))
        try:
            yield m, c
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
            c.close()


@contextmanager
def paused(m: MasterHandle) -> Iterator[None]:
    pause(m.proc.pid)
    try:
        yield
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result (or the exception it raised) and its seconds."""
    t0 = time.monotonic()
    try:
        out: Any = fn()
    except Exception as e:
        out = e
    return out, time.monotonic() - t0


def payload(seed: int) -> dict[str, Any]:
    return {"t": torch.arange(4096, dtype=torch.float32) + seed}


def test_a_paused_master_fails_calls_fast_and_recovers(
    store: tuple[MasterHandle, MooncakeStoreConnector],
) -> None:
    m, c = store
    session = TransferSession(c, "0", "1")
    assert c.put("0", "1", "req-a", payload(0))[0]
    with paused(m):
        # the first send blocks once for the RPC timeout, its retries do not
        out, took = timed(lambda: session.send("req-b", payload(1)))
        assert took < 2 * RPC_TIMEOUT_S, f"send took {took:.1f}s: {out}"
        assert isinstance(out, KVTransferError) and "after 3 attempts" in str(out), out
        assert "RPC_TIMEOUT" in str(out), out
        health = c.health()
        assert health["status"] == "unhealthy" and "RPC_TIMEOUT -901" in health["last_error"]
        calls: dict[str, Callable[[], Any]] = {
            "send": lambda: session.send("req-c", payload(2)),
            "put": lambda: c.put("0", "1", "req-d", payload(3)),
            "cleanup": lambda: c.cleanup("req-a"),
            "get": lambda: c.get("0", "1", "req-a"),
            "discard": lambda: c.discard("0", "1", "req-a"),
            "health": c.health,
        }
        for name, fn in calls.items():
            out, took = timed(fn)
            assert took < FAST_S, f"{name} took {took:.1f}s with the master known down"
            if name in ("send", "put", "get"):
                assert isinstance(out, KVTransferError), (name, out)
                assert f"Mooncake master at {m.master_address} is unreachable" in str(out)
        assert c.health()["pending_keys"] == 1  # req-a: its cleanup waits for the master
    deadline = time.monotonic() + 2 * RPC_TIMEOUT_S + 10
    while True:
        try:
            ok = c.put("0", "1", "req-e", payload(4))[0]
        except KVTransferError:
            ok = False
        if ok:
            break
        assert time.monotonic() < deadline, "the store did not recover after SIGCONT"
        time.sleep(0.1)
    got = c.get("0", "1", "req-e")
    assert got is not None and torch.equal(got[0]["t"], payload(4)["t"])
    assert c.health()["status"] == "healthy", c.health()
    # the cleanup of req-a skipped while the master was down runs once the probe gets an answer
    deadline = time.monotonic() + 5
    while c.health()["pending_keys"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.health()["pending_keys"] == 0, c.health()
    assert int(c.store.is_exist(edge_key("req-a", "0", "1"))) == 0


def test_close_with_the_master_paused_returns_at_once(
    store: tuple[MasterHandle, MooncakeStoreConnector],
) -> None:
    m, c = store
    assert c.put("0", "1", "req-a", payload(0))[0]
    with paused(m):
        ok, _, _ = c.put("0", "1", "req-b", payload(1))
        assert not ok
        out, took = timed(c.close)  # the probe's call is in flight: it closes the store
        assert out is None and took < FAST_S, f"close took {took:.1f}s"
    probes = [t for t in threading.enumerate() if t.name == "omnikv-mooncake-probe"]
    for t in probes:
        t.join(RPC_TIMEOUT_S + 30)
        assert not t.is_alive(), "the probe did not end after the master answered"
    assert c.health()["status"] == "closed"
