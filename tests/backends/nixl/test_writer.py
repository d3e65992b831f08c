"""The producer's half of the WRITE direction (:class:`~vllm_omni_kv.backends.nixl.writer.Writer`),
driven through its side-channel ops, engine-free.

The agent here is a stand-in that records how the writer uses NIXL transfer handles: a
check of a handle after its release reads freed native memory in NIXL (a crash or a
corruption of the producer), which a real agent cannot be made to show on demand.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.prepared_lists import PreparedLists
from vllm_omni_kv.backends.nixl.writer import Writer
from vllm_omni_kv.errors import KVTransferError

SPAN = [0, 1 << 20, "DRAM", 0]


class _Handle:
    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1
        time.sleep(0.002)  # widens the window an abort and the reaper race in


class _Agent:
    """Writes that run until released; every check of a released handle is noted."""

    def __init__(self) -> None:
        self.handles: list[_Handle] = []
        self.misuse: list[str] = []
        self.challenges: dict[str, bytes] = {}
        self.digests: dict[str, bytes] = {}

    def add_remote_agent(self, md: bytes) -> bytes:
        return md.split(b"|")[0]  # the "metadata" is the agent's name (| a variant)

    def remove_remote_agent(self, name: str) -> None:
        pass

    def send_notif(self, name: str, msg: bytes) -> None:
        challenge = ww.parse_challenge(msg)
        if challenge is not None:
            self.challenges[name] = challenge[0]
            self.digests[name] = challenge[1]

    def get_xfer_descs(self, descs: Any, mem: str) -> Any:
        return descs

    def initialize_xfer(self, *args: Any) -> _Handle:
        self.handles.append(_Handle())
        return self.handles[-1]

    def transfer(self, handle: _Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if handle.releases:
            self.misuse.append("checked after its release")
        time.sleep(0.001)
        return "PROC"


def _writer(agent: _Agent, unload: Any = lambda _n: None) -> Writer:
    """A writer over ``agent`` whose own memory is :data:`SPAN`."""
    return Writer(agent, PreparedLists(), lambda: [tuple(SPAN)], unload)  # type: ignore[list-item]


def _write(name: str, token: bytes) -> dict[str, Any]:
    """A one-range write for sink ``name``, signed with ``token``."""
    return ww.with_token(ww.range_write_msgs(name, [(4096, 8192, 4096)], 600.0)[0], token)


def _proven(agent: _Agent, w: Writer, name: str) -> bytes:
    assert w({"op": ww.SINK_OP, "agent": name, "md": name.encode(), "spans": [SPAN]})["ok"]
    token = agent.challenges[name]
    assert w(ww.proof_msg(name, token)) == {"ok": True}
    return token


def test_aborts_racing_the_reaper_never_touch_a_released_handle() -> None:
    agent = _Agent()
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        for i in range(100):
            msg = _write("v", token)
            assert w(msg) == {"ok": True}
            time.sleep(0.003)  # the reaper is checking it now and then
            abort = ww.with_token(ww.abort_msg("v", msg["nonce"]), token)
            assert w(abort)["state"] == "aborted", i
        time.sleep(0.05)
    finally:
        w.close()
    assert agent.misuse == []
    assert [h.releases for h in agent.handles] == [1] * 100


def test_close_during_checks_releases_each_write_once() -> None:
    agent = _Agent()
    w = _writer(agent)
    token = _proven(agent, w, "v")
    for _ in range(50):
        assert w(_write("v", token)) == {"ok": True}
    time.sleep(0.01)  # the reaper is checking them
    w.close()
    assert agent.misuse == []
    assert [h.releases for h in agent.handles] == [1] * 50


def test_one_sink_cannot_take_every_write_slot() -> None:
    from vllm_omni_kv.backends.nixl import writer

    agent = _Agent()
    w = _writer(agent)
    try:
        hog, other = _proven(agent, w, "hog"), _proven(agent, w, "other")
        for _ in range(writer.MAX_RUNNING_PER_SINK):
            assert w(_write("hog", hog)) == {"ok": True}
        assert w(_write("hog", hog)) == {"ok": False, "reason": "busy"}
        assert w(_write("other", other)) == {"ok": True}
    finally:
        w.close()


def test_metadata_naming_another_agent_is_unloaded() -> None:
    """A ``nixl_sink`` whose metadata names another agent than it claims is refused, and
    the agent it loaded is unloaded (no remote agent piles up per such request)."""
    agent, unloaded = _Agent(), []
    w = _writer(agent, unloaded.append)
    try:
        for i in range(3):
            msg = {"op": ww.SINK_OP, "agent": "a", "md": f"stray{i}".encode(), "spans": [SPAN]}
            with pytest.raises(KVTransferError, match="names"):
                w(msg)
        assert {"stray0", "stray1", "stray2"} <= set(unloaded)
    finally:
        w.close()


class _FailingAgent(_Agent):
    """``transfer`` fails after NIXL may have posted part of the write, and the first
    release of its handle is refused."""

    def transfer(self, handle: _Handle) -> str:
        raise RuntimeError("post failed midway")

    def initialize_xfer(self, *args: Any) -> _Handle:
        handle = _RefusingHandle()
        self.handles.append(handle)
        return handle


class _RefusingHandle(_Handle):
    def release(self) -> None:
        self.releases += 1
        if self.releases == 1:
            raise RuntimeError("cannot abort yet")


def test_a_failed_post_whose_handle_cannot_be_released_is_still_tracked() -> None:
    """The sink's abort of a write whose post failed must find it while NIXL may still
    move its bytes, not answer "unknown" (which lets the sink reuse the memory)."""
    agent = _FailingAgent()
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        msg = _write("v", token)
        with pytest.raises(KVTransferError, match="post failed midway"):
            w(msg)
        reply = w(ww.with_token(ww.abort_msg("v", msg["nonce"]), token))
        assert reply["ok"] and reply["state"] != "unknown", reply
    finally:
        w.close()
    assert agent.handles[0].releases >= 2


def _ask(w: Writer, name: str, md: bytes, tokens: tuple[bytes, ...] = ()) -> dict[str, Any]:
    return w(ww.sink_msg(name, md, [tuple(SPAN)], list(tokens)))  # type: ignore[list-item]


def test_a_proof_counts_only_while_its_metadata_is_the_one_loaded() -> None:
    """Two requests name one agent (not yet a sink) with different metadata: the first
    challenge's proof is refused once the second metadata replaced the first, so the
    agent proven is the one NIXL reaches."""
    agent = _Agent()
    w = _writer(agent)
    try:
        assert _ask(w, "v", b"v|mine")["ok"]
        first = agent.challenges["v"]
        assert _ask(w, "v", b"v|other")["ok"]
        refused = w(ww.proof_msg("v", first))
        assert not refused["ok"] and "changed" in refused["error"]
        assert w(ww.proof_msg("v", agent.challenges["v"])) == {"ok": True}
    finally:
        w.close()


def test_a_sinks_metadata_is_replaced_only_with_a_token_it_may_hold() -> None:
    """A proven sink's new metadata needs its token, or the challenge it answered last
    (whose proof may have landed without the answer reaching it); the challenge names
    the request it answers."""
    agent = _Agent()
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        assert agent.digests["v"] == ww.sink_digest(b"v", [tuple(SPAN)])  # type: ignore[list-item]
        refused = _ask(w, "v", b"v|new", (os.urandom(16),))
        assert not refused["ok"] and "token" in refused["error"]
        assert _ask(w, "v", b"v")["ok"]  # the same metadata: no token needed
        answered = agent.challenges["v"]
        assert w(ww.proof_msg("v", answered)) == {"ok": True}
        assert w(_write("v", token)) == {"ok": False, "reason": "need_sink"}  # replaced
        assert _ask(w, "v", b"v|new", (token, answered))["ok"]
        assert w(ww.proof_msg("v", agent.challenges["v"])) == {"ok": True}
    finally:
        w.close()


def test_an_agent_left_with_neither_a_sink_nor_a_request_is_unloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stale proof of an agent that is no longer a sink (evicted) and has no request
    waiting leaves no metadata loaded behind it."""
    from vllm_omni_kv.backends.nixl import sinks

    monkeypatch.setattr(sinks, "MAX_SINKS", 1)
    agent, unloaded = _Agent(), []
    w = _writer(agent, unloaded.append)
    try:
        assert _ask(w, "v", b"v|a")["ok"]
        stale = agent.challenges["v"]
        assert _ask(w, "v", b"v|b")["ok"]
        assert w(ww.proof_msg("v", agent.challenges["v"])) == {"ok": True}
        _proven(agent, w, "w")  # evicts sink v; its first request still waits
        assert "v" not in unloaded
        assert not w(ww.proof_msg("v", stale))["ok"]
        assert "v" in unloaded
    finally:
        w.close()
