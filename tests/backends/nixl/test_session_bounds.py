"""NIXL sessions a peer names are at most ``MAX_SESSION`` characters, and a session's
handshake lock lives only while a handshake of it runs or waits: failed handshakes,
peers unloaded past ``MAX_PEERS`` and many distinct sessions leave none behind. Real
agents, real side-channel servers on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

from vllm_omni_kv.backends.nixl import engine as engine_mod  # noqa: E402
from vllm_omni_kv.backends.nixl.engine import NixlEngine, parse_session  # noqa: E402
from vllm_omni_kv.backends.pull.pull_stream import MAX_SESSION  # noqa: E402
from vllm_omni_kv.backends.pull.side_channel import SideChannelServer  # noqa: E402
from vllm_omni_kv.errors import KVTransferError  # noqa: E402

from ..conformance import wait_until  # noqa: E402

pytestmark = pytest.mark.nixl


@pytest.fixture
def engine() -> Iterator[NixlEngine]:
    e = NixlEngine(handshake_timeout_s=2.0, handshake_retries=0)
    yield e
    e.close()


def test_an_over_long_session_is_refused(engine: NixlEngine) -> None:
    fits = f"omnikv-x@{'h' * (MAX_SESSION - 11)}:1"
    assert len(fits) == MAX_SESSION and parse_session(fits)[0] == "omnikv-x"
    for bad in (f"omnikv-x@{'h' * MAX_SESSION}:1", "a@" + "h" * (1 << 20) + ":1"):
        with pytest.raises(KVTransferError, match="not a NIXL session") as e:
            engine.handshake(bad)
        assert len(str(e.value)) < 400
    assert len(engine._session_locks) == 0 and not engine._peers


def test_failed_handshakes_leave_no_session_lock(engine: NixlEngine) -> None:
    go = threading.Event()
    calls: list[int] = []

    def refuse(msg: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        go.wait(10)
        return {"ok": False, "reason": "error", "error": "not nixl"}

    server = SideChannelServer("127.0.0.1", 0, refuse)
    try:
        same = f"omnikv-a@127.0.0.1:{server.port}"
        errors: list[BaseException] = []

        def one() -> None:
            try:
                engine.handshake(same)
            except KVTransferError as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(calls) == 1, 5.0)
        assert len(engine._session_locks) == 1  # held by one, waited for by two
        go.set()
        for t in threads:
            t.join(10)
        assert len(errors) == 3 and len(engine._session_locks) == 0
        for i in range(100):  # many distinct sessions, each refused
            with pytest.raises(KVTransferError, match="does not serve"):
                engine.handshake(f"omnikv-{i:016x}@127.0.0.1:{server.port}")
        assert len(engine._session_locks) == 0 and not engine._peers
    finally:
        go.set()
        server.close()


def test_unloaded_peers_leave_no_session_lock(
    engine: NixlEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_mod, "MAX_PEERS", 2)
    peers = [NixlEngine() for _ in range(3)]
    servers = [
        SideChannelServer("127.0.0.1", 0, lambda m, p=p: {"ok": True, **p.metadata()})
        for p in peers
    ]
    try:
        for p, s in zip(peers, servers, strict=True):
            p.advertise("127.0.0.1", s.port)
        for _ in range(2):  # the first peer is unloaded, then loaded again
            for p in peers:
                assert engine.handshake(p.session).name == p.name
                assert len(engine._peers) <= 2
        assert len(engine._session_locks) == 0
        engine.forget(peers[2].session)
        assert len(engine._session_locks) == 0 and len(engine._peers) == 1
    finally:
        for s in servers:
            s.close()
        for p in peers:
            p.close()
