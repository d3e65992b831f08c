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

from .fake_transfers import TimedHandle

SPAN = [0, 4 << 20, "DRAM", 0]


class _Handle(TimedHandle):
    def __init__(self, ends_at: float = float("inf"), end: str = "DONE") -> None:
        super().__init__(ends_at, end, pause_s=0.002)  # widens an abort's race with the reaper


class _Agent:
    """Writes that run until released; every check of a released handle is noted."""

    def __init__(self) -> None:
        self.handles: list[_Handle] = []
        self.misuse: list[str] = []
        self.challenges: dict[str, bytes] = {}
        self.digests: dict[str, bytes] = {}
        self.notified: list[tuple[str, bytes]] = []
        self.removed: list[str | bytes] = []
        self.loads = 0
        self.runs_s, self.end = float("inf"), "DONE"  # how each new write runs and ends

    def add_remote_agent(self, md: bytes) -> bytes:
        self.loads += 1
        return md.split(b"|")[0]  # the "metadata" is the agent's name (| a variant)

    def remove_remote_agent(self, name: str | bytes) -> None:
        self.removed.append(name)

    def send_notif(self, name: str, msg: bytes) -> None:
        self.notified.append((name, msg))
        challenge = ww.parse_challenge(msg)
        if challenge is not None:
            self.challenges[name] = challenge[0]
            self.digests[name] = challenge[1]

    def get_xfer_descs(self, descs: Any, mem: str) -> Any:
        return descs

    def initialize_xfer(self, *args: Any) -> _Handle:
        self.handles.append(_Handle(time.monotonic() + self.runs_s, self.end))
        return self.handles[-1]

    def transfer(self, handle: _Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if handle.releases:
            self.misuse.append("checked after its release")
        time.sleep(0.001)
        return handle.state()


def _writer(agent: _Agent, unload: Any = lambda _n: None) -> Writer:
    """A writer over ``agent`` whose own memory is :data:`SPAN`."""
    return Writer(agent, PreparedLists(), lambda: [tuple(SPAN)], unload)  # type: ignore[list-item]


def _write(name: str, token: bytes, ttl_s: float = 600.0, large: bool = False) -> dict[str, Any]:
    """A one-range write for sink ``name``, signed with ``token`` (``large``: of 4 MiB,
    made and posted on the writer's poster thread)."""
    row = (0, 0, 4 << 20) if large else (4096, 8192, 4096)
    return ww.with_token(ww.range_write_msgs(name, [row], ttl_s)[0], token)


def _proven(agent: _Agent, w: Writer, name: str) -> bytes:
    assert w({"op": ww.SINK_OP, "agent": name, "md": name.encode(), "spans": [SPAN]})["ok"]
    token = agent.challenges[name]
    assert w(ww.proof_msg(name, token)) == {"ok": True}
    return token


def _posted(agent: _Agent, n: int) -> None:
    """Wait until the writer's poster has made ``n`` writes."""
    deadline = time.monotonic() + 10
    while len(agent.handles) < n and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert len(agent.handles) >= n


def test_aborts_racing_the_reaper_never_touch_a_released_handle() -> None:
    """Each write runs 10 ms: aborts sent while it runs are answered ``running`` (releasing
    a running write does not stop its bytes over every transport), the first after its end
    no longer ``running``; the reaper and the aborts release each handle once, after its
    end, and never check a released one."""
    agent = _Agent()
    agent.runs_s = 0.01
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        for i in range(60):
            msg = _write("v", token)
            assert w(msg) == {"ok": True}
            _posted(agent, i + 1)
            abort = ww.with_token(ww.abort_msg("v", msg["nonce"]), token)
            states = [w(abort)["state"]]
            while states[-1] == "running":
                time.sleep(0.002)
                states.append(w(abort)["state"])
            # aborted or unknown: the reaper released or ended it meanwhile
            assert states[-1] in ("done", "aborted", "unknown"), (i, states)
            assert states[0] == "running" or time.monotonic() >= agent.handles[-1].ends_at, i
        time.sleep(0.05)
    finally:
        w.close()
    assert agent.misuse == []
    assert [h.releases for h in agent.handles] == [1] * 60
    assert not any(h.released_running for h in agent.handles)


@pytest.mark.parametrize("end", ["DONE", "ERR"])
def test_a_write_past_its_ttl_is_waited_for_to_its_end(end: str) -> None:
    """A write that outruns its ``ttl_s`` is not released while it runs (its sink's memory
    may still be written); once it ends it is released, and a failed one is told to its
    sink (``E`` + nonce; NIXL itself sends ``D`` after a write that completed)."""
    agent = _Agent()
    agent.runs_s, agent.end = 0.3, end
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        msg = _write("v", token, ttl_s=0.05)
        assert w(msg) == {"ok": True}
        time.sleep(0.2)  # past its ttl, still running
        handle = agent.handles[-1]
        assert handle.releases == 0
        abort = ww.with_token(ww.abort_msg("v", msg["nonce"]), token)
        assert w(abort)["state"] == "running"

        def told() -> int:
            return sum(m == b"E" + msg["nonce"] for _name, m in agent.notified)

        want = 1 if end == "ERR" else 0
        deadline = time.monotonic() + 5
        while (handle.releases == 0 or told() < want) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # nothing more comes
        assert handle.releases == 1 and not handle.released_running
        assert told() == want
    finally:
        w.close()


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


def test_metadata_naming_an_agent_that_is_not_utf8_is_refused_and_unloaded() -> None:
    """An agent name of bytes that are not UTF-8 is refused with a ``KVTransferError``
    (not a ``UnicodeDecodeError``), and the agent it loaded is unloaded by those bytes."""
    agent = _Agent()
    w = _writer(agent)
    try:
        bad = b"stray-\xff\xfe"
        with pytest.raises(KVTransferError, match="names"):
            w({"op": ww.SINK_OP, "agent": "a", "md": bad, "spans": [SPAN]})
        assert bad in agent.removed
    finally:
        w.close()


def test_a_flood_of_sink_requests_under_fresh_names_loads_few_agents() -> None:
    """NIXL keeps sockets open for every remote agent loaded and removed again: requests
    under fresh names load at most ``MAX_PENDING`` at once and then ``LOAD_RATE`` a
    second; the rest are answered ``busy`` without a load."""
    from vllm_omni_kv.backends.nixl import sinks

    agent = _Agent()
    w = _writer(agent)
    try:
        t0 = time.monotonic()
        replies = [
            w({"op": ww.SINK_OP, "agent": f"a{i}", "md": f"a{i}".encode(), "spans": [SPAN]})
            for i in range(500)
        ]
        elapsed = time.monotonic() - t0
        busy = sum(r == {"ok": False, "reason": "busy"} for r in replies)
        assert agent.loads == 500 - busy
        assert agent.loads <= sinks.MAX_PENDING + sinks.LOAD_RATE * elapsed + 1, agent.loads
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
        assert w(msg) == {"ok": True}  # posted (and failed) on the poster's thread
        _posted(agent, 1)
        time.sleep(0.05)
        reply = w(ww.with_token(ww.abort_msg("v", msg["nonce"]), token))
        assert reply["ok"] and reply["state"] != "unknown", reply
    finally:
        w.close()
    assert agent.handles[0].releases >= 2


class _SlowAgent(_Agent):
    """Each post copies for 0.3 s before it returns (UCX's shared-memory transports copy a
    large write inside ``transfer``)."""

    def transfer(self, handle: _Handle) -> str:
        time.sleep(0.3)
        return "DONE"


def test_the_side_channel_answers_while_a_write_is_posted() -> None:
    """Writes of 4 MiB and more are made and posted on a thread of their own: while one
    copies, the writer answers other requests at once, and an abort of a write still
    waiting to be posted withdraws it (``aborted``; it is never made)."""
    agent = _SlowAgent()
    agent.runs_s = 0.0
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        first, second = _write("v", token, large=True), _write("v", token, large=True)
        assert w(first) == {"ok": True} and w(second) == {"ok": True}
        _posted(agent, 1)  # the first is copying now, the second waits
        t0 = time.monotonic()
        abort = w(ww.with_token(ww.abort_msg("v", second["nonce"]), token))
        assert _proven(agent, w, "other")  # another sink is served meanwhile
        assert time.monotonic() - t0 < 0.2
        assert abort == {"ok": True, "state": "aborted"}
        time.sleep(0.5)
        assert len(agent.handles) == 1  # the withdrawn write was never made
        assert w(second) == {"ok": False, "reason": "error", "error": "nonce already used"}
    finally:
        w.close()


class _NoMemoryAgent(_Agent):
    def initialize_xfer(self, *args: Any) -> _Handle:
        raise RuntimeError("no such memory")


@pytest.mark.parametrize("large", [False, True], ids=["posted here", "posted by the poster"])
def test_a_write_that_cannot_be_made_is_told_to_its_sink(large: bool) -> None:
    """A write that cannot be made (nothing of it runs) is told to its sink (``E`` +
    nonce), made on the side-channel thread or on the poster's; its nonce is not taken
    again."""
    agent = _NoMemoryAgent()
    w = _writer(agent)
    try:
        token = _proven(agent, w, "v")
        msg = _write("v", token, large=large)
        assert w(msg) == {"ok": True}
        deadline = time.monotonic() + 5
        while ("v", b"E" + msg["nonce"]) not in agent.notified:
            assert time.monotonic() < deadline, agent.notified
            time.sleep(0.01)
        assert w(msg)["reason"] == "error"
    finally:
        w.close()


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
