"""NIXL's WRITE direction on real agents (UCX over loopback): the producer WRITEs into the
consumer's pool or registered cache, exact bytes; a client that copied another agent's
metadata never aims writes at it; a used nonce is refused; a paused producer is waited
out (the consumer's memory stays held) and a dead one ends the wait."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from _pause import pause

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

from vllm_omni_kv.backends.nixl import write_wire as ww  # noqa: E402
from vllm_omni_kv.backends.nixl.connector import NixlPullConnector, write_selftest  # noqa: E402
from vllm_omni_kv.backends.pull.page_reads import PageReads, PageTable, group_ids  # noqa: E402
from vllm_omni_kv.backends.pull.selftest import pull_round_trip  # noqa: E402
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient  # noqa: E402
from vllm_omni_kv.errors import KVTransferError  # noqa: E402

from ..conformance import SenderProcess, nixl_config, wait_until  # noqa: E402

pytestmark = pytest.mark.nixl


def _conn(role: str, **over: Any) -> NixlPullConnector:
    return NixlPullConnector(nixl_config(role, pool_mib=16, **over))


def _endpoint(c: NixlPullConnector) -> str:
    return f"tcp://127.0.0.1:{c.zmq_port}"


def test_pool_and_cache_moves_are_written_by_the_producer() -> None:
    """Exact bytes both ways (checked by the round trips), and no READ posted by the
    consumer: every post is the producer's WRITE."""
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    reads: list[str] = []
    agent = receiver.engine.agent  # type: ignore[attr-defined]
    for name in ("initialize_xfer", "make_prepped_xfer"):
        inner = getattr(agent, name)
        setattr(agent, name, lambda *a, _f=inner, **k: reads.append(a[0]) or _f(*a, **k))
    try:
        assert pull_round_trip(sender, receiver) is None
        assert reads == []
    finally:
        receiver.close()
        sender.close()
    got = write_selftest()  # doctor --selftest's row
    assert got["ok"] and got["transport"] == "nixl:UCX/write", got


def test_a_client_with_copied_metadata_cannot_aim_writes_at_its_owner() -> None:
    """A client sends a victim's metadata as its own sink: the producer challenges the
    victim (who ignores it), the client cannot echo the challenge, writes are refused."""
    sender, victim = _conn("sender"), _conn("receiver", nixl_direction="write")
    client = SideChannelClient(5.0)
    try:
        v = victim.engine  # type: ignore[attr-defined]
        spans = [list(s) for s in v._spans()]
        sink = {
            "op": ww.SINK_OP,
            "agent": v.name,
            "md": v.agent.get_agent_metadata(),
            "spans": spans,
        }
        assert client.request(_endpoint(sender), sink).get("challenged")
        forged = client.request(_endpoint(sender), ww.proof_msg(v.name, os.urandom(16)))
        assert not forged["ok"] and "challenge" in forged["error"]
        rows = [(victim.base_ptr, sender.base_ptr, 4096)]
        write = ww.with_token(ww.range_write_msgs(v.name, rows, 1.0)[0], os.urandom(16))
        assert client.request(_endpoint(sender), write) == {"ok": False, "reason": "need_sink"}
    finally:
        client.close()
        victim.close()
        sender.close()


def test_metadata_forged_under_a_proven_sinks_name_is_refused() -> None:
    """A client runs its own NIXL agent under a proven sink's name and sends that agent's
    metadata as the sink's: without the sink's token it is refused and not loaded, so the
    sink's writes still reach the sink (exact bytes)."""
    from nixl._api import nixl_agent, nixl_agent_config

    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    client = SideChannelClient(5.0)
    impostor = None
    try:
        assert pull_round_trip(sender, receiver) is None  # the receiver is a proven sink
        r = receiver.engine  # type: ignore[attr-defined]
        impostor = nixl_agent(r.name, nixl_agent_config(backends=["UCX"]))
        forged = ww.sink_msg(r.name, impostor.get_agent_metadata(), r._spans(), [])
        reply = client.request(_endpoint(sender), forged)
        assert not reply["ok"] and "token" in reply["error"], reply
        assert pull_round_trip(sender, receiver) is None
    finally:
        client.close()
        receiver.close()
        sender.close()
        del impostor


def test_a_sink_whose_registrations_changed_proves_itself_again_with_its_token() -> None:
    """The consumer registers more memory (new metadata): its next move proves it again,
    the producer replaces its metadata for the sink's token, and the bytes are exact."""
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    extra = np.zeros(1 << 20, dtype=np.uint8)
    try:
        assert pull_round_trip(sender, receiver) is None
        receiver.engine.register(extra.ctypes.data, extra.nbytes)  # type: ignore[attr-defined]
        assert pull_round_trip(sender, receiver) is None
    finally:
        receiver.close()
        sender.close()


def test_a_sinks_metadata_stays_loaded_when_the_agent_forgets_a_peer_of_its_name() -> None:
    """An agent that also READs from its sink drops that peer after a failed read: the
    sink's metadata stays loaded (only the lists prepared over it go), so writes to it go on."""
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    try:
        assert pull_round_trip(sender, receiver) is None
        s = sender.engine  # type: ignore[attr-defined]
        s._unload(receiver.engine.name)  # type: ignore[attr-defined]  # what forget() runs
        assert pull_round_trip(sender, receiver) is None
    finally:
        receiver.close()
        sender.close()


def _as_sink(receiver: NixlPullConnector, sender: NixlPullConnector, msg: dict[str, Any]) -> Any:
    """``msg`` signed as the proven sink ``receiver`` signs it for ``sender`` (its token)."""
    return receiver.engine._writes._signed(_endpoint(sender), msg)  # type: ignore[attr-defined]


def test_a_nonce_once_aborted_or_used_is_refused() -> None:
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    client = SideChannelClient(5.0)
    try:
        assert pull_round_trip(sender, receiver) is None  # the receiver is a proven sink now
        name = receiver.engine.name  # type: ignore[attr-defined]
        rows = [(receiver.base_ptr, sender.base_ptr, 4096)]
        late = _as_sink(receiver, sender, ww.range_write_msgs(name, rows, 1.0)[0])
        abort = _as_sink(receiver, sender, ww.abort_msg(name, late["nonce"]))
        assert client.request(_endpoint(sender), abort) == {"ok": True, "state": "unknown"}
        refused = client.request(_endpoint(sender), late)
        assert not refused["ok"] and "nonce" in refused["error"]
        outside = ww.range_write_msgs(name, [(1 << 12, sender.base_ptr, 4096)], 1.0)[0]
        refused = client.request(_endpoint(sender), _as_sink(receiver, sender, outside))
        assert not refused["ok"] and "registered" in refused["error"]
    finally:
        client.close()
        receiver.close()
        sender.close()


def test_a_proven_sinks_writes_tables_and_aborts_need_its_token() -> None:
    """A client that knows a proven sink's name (and spans) but not its token can neither
    aim a write or a table set at it nor abort, or pre-empt with an abort, its writes."""
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    client = SideChannelClient(5.0)
    try:
        assert pull_round_trip(sender, receiver) is None
        name, ep = receiver.engine.name, _endpoint(sender)  # type: ignore[attr-defined]
        rows = [(receiver.base_ptr, sender.base_ptr, 4096)]
        write = ww.range_write_msgs(name, rows, 1.0)[0]
        guess = os.urandom(16)
        assert client.request(ep, ww.with_token(write, guess)) == {
            "ok": False,
            "reason": "need_sink",
        }
        table = PageTable(receiver.base_ptr, 4096, 4096, 1)
        reads = PageReads((table,), (table,), *group_ids((table,), (table,), ()), 0, ())
        tables = ww.with_token(ww.tables_msg(name, reads), guess)
        assert client.request(ep, tables) == {"ok": False, "reason": "need_sink"}
        # an abort without the token leaves no mark: the sink's own write with that nonce runs
        pre = client.request(ep, ww.with_token(ww.abort_msg(name, write["nonce"]), guess))
        assert pre == {"ok": True, "state": "unknown"}
        assert client.request(ep, _as_sink(receiver, sender, write)) == {"ok": True}
        ran = client.request(ep, ww.with_token(ww.abort_msg(name, write["nonce"]), guess))
        assert ran.get("state") == "unknown" or not ran["ok"], ran  # ended, or not its write
    finally:
        client.close()
        receiver.close()
        sender.close()


def _load(stream: Any, failed: list[str]) -> None:
    """Load all of ``stream`` (then close it); a failure's message goes to ``failed``."""
    try:
        with stream:
            for _ in stream.load(None, time.monotonic() + 30):
                pass
    except KVTransferError as e:
        failed.append(str(e))


def _held_until_killed(proc: SenderProcess, r: NixlPullConnector) -> None:
    """``r``'s pool memory that paused ``proc``'s writes target is still held; once
    ``proc`` is killed it is given back."""
    assert r.pool.allocator.used > 0, "memory a paused producer may still write was freed"
    proc.proc.kill()
    proc.proc.join(10)
    assert wait_until(lambda: r.pool.allocator.used == 0, 15), r.pool.stats()


@pytest.mark.slow
def test_a_paused_producer_is_waited_out_and_a_dead_one_ends_the_wait() -> None:
    """SIGSTOP the producer before the consumer asks for its writes: the load fails within
    the transfer timeout, but the pool memory the writes target stays held while the
    producer may still wake and write; SIGKILL ends that at once."""
    proc = SenderProcess(nixl_config("sender", pool_mib=16), backend="nixl")
    r = _conn(
        "receiver", nixl_direction="write", transfer_timeout_s=2.0, side_channel_timeout_s=1.0
    )
    try:
        data = {f"l{i}": torch.full((1024, 64), float(i)) for i in range(8)}
        meta = proc.call(op="put", key="paused", data=data)["meta"]
        stream = r.open_stream("0", "1", "paused", meta)
        assert stream is not None and stream.moved < stream.size
        pause(proc.proc.pid)  # every thread stopped: none may still serve the request
        failed: list[str] = []
        t0 = time.monotonic()
        t = threading.Thread(target=_load, args=(stream, failed))
        t.start()
        t.join(10)
        assert failed and time.monotonic() - t0 < 8.0, "the load did not fail in bounded time"
        time.sleep(2.0)
        _held_until_killed(proc, r)
    finally:
        r.close()
        proc.stop()


def test_moves_waited_out_on_a_paused_producer_leave_the_pull_threads_free() -> None:
    """Six loads from a paused producer fail in bounded time and the memory their writes
    target stays held, but no pull thread waits for that producer meanwhile (there are
    four): pulls from a healthy producer go on at once. SIGKILL gives the memory back."""
    proc = SenderProcess(nixl_config("sender", pool_mib=16), backend="nixl")
    healthy = _conn("sender")
    r = _conn(
        "receiver", nixl_direction="write", transfer_timeout_s=1.0, side_channel_timeout_s=1.0
    )
    try:
        data = {f"l{i}": torch.full((1024, 64), float(i)) for i in range(4)}
        metas = [proc.call(op="put", key=f"p{i}", data=data)["meta"] for i in range(6)]
        streams = [r.open_stream("0", "1", f"p{i}", m) for i, m in enumerate(metas)]
        pause(proc.proc.pid)
        failed: list[str] = []
        loads = [threading.Thread(target=_load, args=(st, failed)) for st in streams]
        for t in loads:
            t.start()
        for t in loads:
            t.join(20)
        assert len(failed) == 6, failed
        t0 = time.monotonic()
        assert pull_round_trip(healthy, r) is None
        assert time.monotonic() - t0 < 5.0, "pulls from a healthy producer waited"
        _held_until_killed(proc, r)
    finally:
        r.close()
        healthy.close()
        proc.stop()


def test_threads_that_find_their_sink_forgotten_prove_it_once() -> None:
    """The producer forgets a proven sink (what an eviction or a restart on the same port
    does; made by clearing its table): eight threads' moves all get ``need_sink`` and each
    would prove the sink again, replacing the token the others' writes just carried. One
    proof per forgetting is made, and every move lands."""
    sender = _conn("sender")
    receiver = _conn("receiver", nixl_direction="write", transfer_timeout_s=10.0)
    eng, session = receiver.engine, sender.engine.session  # type: ignore[attr-defined]
    writes, sinks = eng._writes, sender.engine.writer._sinks  # type: ignore[attr-defined]
    proofs: list[str] = []
    prove_now = writes._prove_now
    writes._prove_now = lambda *a: (proofs.append(a[0]), prove_now(*a))[1]
    src = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 20)).from_address(sender.base_ptr))
    src[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    errors: list[str] = []
    try:
        eng.read_many(session, [(receiver.base_ptr, sender.base_ptr, 4096)])  # proven once
        for _ in range(4):
            with sinks._lock:
                sinks._sinks.clear()
            barrier = threading.Barrier(8)

            def move(i: int, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                off = i * 4096
                try:
                    eng.read_many(session, [(receiver.base_ptr + off, sender.base_ptr + off, 4096)])
                except KVTransferError as e:
                    errors.append(str(e))

            threads = [threading.Thread(target=move, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        dst = np.ctypeslib.as_array((ctypes.c_uint8 * (8 * 4096)).from_address(receiver.base_ptr))
        assert not errors, errors[:3]
        assert np.array_equal(dst, src[: 8 * 4096])
        assert len(proofs) == 1 + 4, len(proofs)
    finally:
        receiver.close()
        sender.close()


def _registered_cache(c: NixlPullConnector) -> torch.Tensor:
    assert c.cache_region is not None
    with c.cache_region.allocation_context():
        buf = torch.zeros(4 * 1024 * 256, dtype=torch.int8)  # >= 1 MiB: the cache
    return buf.view(4, 1024, 256)[:3]


def _tables(cache: torch.Tensor) -> tuple[PageTable, ...]:
    return tuple(PageTable(cache[i].data_ptr(), 256, 256, 1024) for i in range(3))


def test_page_writes_post_once_per_group_whatever_the_pages() -> None:
    """Real agents: one producer WRITE per move of 4 / 64 / 1,024 pages (3 layers), the
    bytes exact, whatever the page count. The consumer registers its cache after its first
    (pool) move: it proves itself again with its new metadata before the page writes."""
    sender = _conn("sender", register_cache=True)
    receiver = _conn("receiver", nixl_direction="write", register_cache=True)
    src = _registered_cache(sender)
    assert pull_round_trip(sender, receiver) is None
    dst = _registered_cache(receiver)
    src.copy_(torch.randint(-128, 127, src.shape, dtype=torch.int8))
    posts: list[str] = []
    w = sender.engine.writer  # type: ignore[attr-defined]
    inner = w._agent.make_prepped_xfer
    w._agent.make_prepped_xfer = lambda *a, **k: posts.append(a[0]) or inner(*a, **k)
    try:
        session = sender.engine.session  # type: ignore[attr-defined]
        rt, lt = _tables(src), _tables(dst)
        rng = np.random.default_rng(1)
        for n in (4, 64, 1024):
            pairs = np.stack([rng.permutation(1024)[:n], rng.permutation(1024)[:n]], 1)
            groups = ((np.arange(3, dtype=np.int64), pairs.astype(np.int64)),)
            reads = PageReads(rt, lt, *group_ids(rt, lt, groups), n * 768, groups)
            receiver.engine.read_pages(session, reads)  # type: ignore[attr-defined]
            s_ids, d_ids = pairs[:, 0].tolist(), pairs[:, 1].tolist()
            assert torch.equal(dst[:, d_ids], src[:, s_ids])
        assert posts == ["WRITE"] * 3, posts
    finally:
        receiver.close()
        sender.close()


def test_closed_connectors_let_go_of_their_agents_at_once() -> None:
    """After writes both ways, closing destroys each NIXL agent without waiting for the
    garbage collector (an agent's UCX progress thread busy-polls while it lives)."""
    sender, receiver = _conn("sender"), _conn("receiver", nixl_direction="write")
    assert pull_round_trip(sender, receiver) is None
    agents = [weakref.ref(c.engine.agent) for c in (sender, receiver)]  # type: ignore[attr-defined]
    gc.disable()
    try:
        receiver.close()
        sender.close()
        assert [a() for a in agents] == [None, None]
    finally:
        gc.enable()


def test_a_closing_producer_ends_its_writes_before_refusing_connections() -> None:
    """A consumer takes a refused side-channel connection for "no write of that producer
    can land any more": when a producer closes, its writes are ended (aborted) while its
    side channel still accepts connections."""
    from vllm_omni_kv.backends.nixl.wait_outs import _gone

    sender = _conn("sender")
    endpoint, writer = _endpoint(sender), sender.engine.writer  # type: ignore[attr-defined]
    refused_at_close: list[bool] = []
    close = writer.close

    def spy() -> None:
        refused_at_close.append(_gone(endpoint))
        close()

    writer.close = spy
    sender.close()
    assert refused_at_close[:1] == [False], "the side channel closed before the writes ended"
    assert _gone(endpoint)


def test_a_producer_that_never_challenges_does_not_hold_up_proofs_to_others() -> None:
    """A consumer proving itself to a producer that never sends its challenge (paused,
    or unable to reach it over UCX) waits up to its side-channel timeout for it; proofs
    and moves to other producers go on meanwhile."""
    from vllm_omni_kv.backends.pull.side_channel import SideChannelServer

    silent = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True, "challenged": True})
    sender = _conn("sender")
    receiver = _conn("receiver", nixl_direction="write", side_channel_timeout_s=8.0)
    writes = receiver.engine._writes  # type: ignore[attr-defined]
    failed: list[BaseException] = []

    def prove_to_silent() -> None:
        try:
            writes._prove(silent.endpoint, "silent-agent", None)
        except KVTransferError as e:
            failed.append(e)

    t = threading.Thread(target=prove_to_silent)
    try:
        t.start()
        time.sleep(0.3)  # its proof is waiting for a challenge that never comes
        assert pull_round_trip(sender, receiver) is None  # proves itself to the sender
        assert t.is_alive(), "the silent producer's proof ended before the other move"
        t.join(30)
        assert failed and "no challenge" in str(failed[0])
        assert not writes._proving  # a proof lock lives only while a proof is under way
    finally:
        t.join(30)
        receiver.close()
        sender.close()
        silent.close()


def test_proofs_to_one_producer_take_turns_and_leave_no_lock_behind() -> None:
    """Two proofs to the same producer run one after the other (each waits its own
    side-channel timeout for the challenge); proofs to others run meanwhile; once they
    end, nothing is kept per producer."""
    from vllm_omni_kv.backends.pull.side_channel import SideChannelServer

    silent = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True, "challenged": True})
    receiver = _conn("receiver", nixl_direction="write", side_channel_timeout_s=0.5)
    writes = receiver.engine._writes  # type: ignore[attr-defined]
    ended: dict[str, float] = {}

    def prove(peer: str, tag: str) -> None:
        with pytest.raises(KVTransferError, match="no challenge"):
            writes._prove(silent.endpoint, peer, None)
        ended[tag] = time.monotonic()

    jobs = [("same", "a"), ("same", "b")] + [(f"other{i}", f"o{i}") for i in range(8)]
    threads = [threading.Thread(target=prove, args=job) for job in jobs]
    try:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(ended) == len(jobs)
        assert max(ended["a"], ended["b"]) - t0 >= 2 * 0.5  # one after the other
        assert not writes._proving
    finally:
        receiver.close()
        silent.close()
