"""NIXL backend: ranged pulls, handshake bounds, a sender dying mid-pull, N consumers, expiry.

Senders in another process are real processes (``SenderProcess``); the handshake and
every pull go over real NIXL agents (UCX) and a real ZMQ side channel.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

from vllm_omni_kv.backends.factory import OmniConnectorFactory  # noqa: E402
from vllm_omni_kv.backends.nixl.connector import NixlPullConnector, selftest  # noqa: E402
from vllm_omni_kv.backends.pull.side_channel import (  # noqa: E402
    SideChannelClient,
    SideChannelServer,
)
from vllm_omni_kv.backends.spec import ConnectorSpec  # noqa: E402
from vllm_omni_kv.errors import (  # noqa: E402
    BackendUnavailable,
    KVPayloadError,
    KVTransferError,
    KVTransferTimeout,
)
from vllm_omni_kv.wire.auth import AuthKey  # noqa: E402
from vllm_omni_kv.wire.stream import tensor_span  # noqa: E402

from ..conformance import SenderProcess, nixl_config, wait_until  # noqa: E402

pytestmark = pytest.mark.nixl


def _conn(role: str, pool_mib: int = 16, **over: Any) -> NixlPullConnector:
    return NixlPullConnector(nixl_config(role, pool_mib=pool_mib, **over))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def receivers() -> Iterator[list[NixlPullConnector]]:
    rs = [_conn("receiver") for _ in range(2)]
    yield rs
    leaked = [r.pool.allocator.used for r in rs]
    for r in rs:
        r.close()
    assert leaked == [0, 0], f"receiver pool blocks never released: {leaked}"


def _layers(n: int = 8, rows: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"l{i}": torch.randn(rows, 64, generator=g) for i in range(n)}  # 1 MiB each


def test_load_pulls_only_the_spans_it_is_asked_for(receivers: list[NixlPullConnector]) -> None:
    s = _conn("sender")
    try:
        layers = _layers()
        _ok, size, meta = s.put("0", "1", "ranged", layers)
        r = receivers[0]
        stream = r.open_stream("0", "1", "ranged", meta)
        assert stream is not None
        with stream:
            head = stream.moved
            part = stream.obj["l5"][1000:1200]
            for _ in stream.load([tensor_span(stream, part)], time.monotonic() + 20):
                pass
            assert torch.equal(part, layers["l5"][1000:1200])
            # header + the chunks covering 200 rows (50 KiB): far less than the 8 MiB frame
            assert stream.moved - head < 1 << 20 and stream.moved < size // 4
        assert wait_until(lambda: s.pool.allocator.used == 0, 5), "block not freed after release"
    finally:
        s.close()


def test_handshake_with_a_port_where_nothing_answers_is_bounded() -> None:
    r = _conn("receiver", handshake_timeout_s=0.5, handshake_retries=1, side_channel_timeout_s=1.0)
    try:
        port = _free_port()  # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(KVTransferTimeout, match="2 tries"):
            r._nixl.handshake(f"omnikv-nobody@127.0.0.1:{port}")  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 5.0
        # the same through a get with full put metadata: no acquire, the pull's handshake fails
        md = {
            "data_size": 4096,
            "src_addr": 1 << 20,
            "session": f"omnikv-nobody@127.0.0.1:{port}",
            "token": "t",
            "is_fast_path": True,
            "source_host": "127.0.0.1",
            "source_port": port,
        }
        before = r.health()["failures"]
        t0 = time.monotonic()
        assert r.get("0", "1", "k", md) is None
        assert time.monotonic() - t0 < 8.0
        assert r.health()["failures"] == before + 1
        assert r.pool.allocator.used == 0
    finally:
        r.close()


def test_handshake_with_a_side_channel_that_is_not_nixl_is_an_error() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": False, "reason": "error"})
    r = _conn("receiver")
    try:
        with pytest.raises(KVTransferError, match="does not serve NIXL agent"):
            r._nixl.handshake(f"omnikv-x@127.0.0.1:{server.port}")  # type: ignore[union-attr]
        with pytest.raises(KVTransferError, match="not a NIXL session"):
            r._nixl.handshake("127.0.0.1:5555")  # type: ignore[union-attr]
    finally:
        r.close()
        server.close()


@pytest.mark.slow
def test_sender_dies_mid_pull_clean_error_no_leak(caplog: pytest.LogCaptureFixture) -> None:
    """Kill the sender after the receiver opened the stream (lease + header pulled) and
    before it pulled the rest: the load fails with a KVTransferError within the timeout."""
    # pytest keeps log records; the warning about the unconfirmed release holds the failure's
    # exceptions, whose tracebacks reach the stream and its receive block: keep it unlogged
    caplog.set_level(logging.ERROR, logger="vllm_omni_kv.backends.pull.pull")
    proc = SenderProcess(nixl_config("sender", pool_mib=64), backend="nixl")
    r = _conn("receiver", pool_mib=64, transfer_timeout_s=3.0, side_channel_timeout_s=1.0)
    try:
        layers = _layers(16)
        meta = proc.call(op="put", key="dying", data=layers)["meta"]
        stream = r.open_stream("0", "1", "dying", meta)
        assert stream is not None and stream.moved < stream.size
        proc.proc.kill()
        proc.proc.join(10)
        t0 = time.monotonic()
        failed = ""
        try:
            with stream:
                for _ in stream.load(None, time.monotonic() + 30):
                    pass
        except KVTransferError as e:  # not kept: its traceback pins the receive block
            failed = str(e)
        assert failed, "the load from a dead sender succeeded"
        assert time.monotonic() - t0 < 3.0 + 3.0  # transfer_timeout_s + slack
        del stream
        gc.collect()  # the failed read's traceback and its future form a reference cycle
        assert wait_until(lambda: r.pool.allocator.used == 0, 5), r.pool.stats()
        # the dead peer was forgotten: a new pull fails at its handshake, bounded too
        t0 = time.monotonic()
        assert r.get("0", "1", "dying", meta) is None
        assert time.monotonic() - t0 < 8.0
        assert r.pool.allocator.used == 0
    finally:
        r.close()
        proc.stop()


@pytest.mark.slow
def test_two_consumers_in_parallel_then_exhausted(receivers: list[NixlPullConnector]) -> None:
    proc = SenderProcess(nixl_config("sender", pool_mib=32, max_pulls=2), backend="nixl")
    try:
        layers = _layers(4)
        meta = proc.call(op="put", key="shared", data=layers)["meta"]
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
        results: list[Any] = [None, None]

        def fetch(i: int) -> None:
            results[i] = receivers[i].get("0", "1", "shared", md)

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for got in results:
            assert got is not None
            assert all(torch.equal(got[0][k], v) for k, v in layers.items())
        assert receivers[0].get("0", "1", "shared", md) is None  # a third pull: exhausted
        health = proc.call(op="health")["health"]
        assert health["exposed_blocks"] == 0 and health["active_leases"] == 0, health
    finally:
        proc.stop()


def test_ttl_expiry_frees_unpulled_buffers(receivers: list[NixlPullConnector]) -> None:
    s = _conn("sender", buffer_ttl_s=0.3)
    try:
        _ok, _size, meta = s.put("0", "1", "stale", torch.ones(1 << 16))
        assert s.pool.allocator.used > 0
        assert wait_until(lambda: s.pool.allocator.used == 0, 5), "TTL did not free the buffer"
        assert s.health()["expired"] == 1
        assert receivers[0].get("0", "1", "stale", meta) is None
    finally:
        s.close()


def test_abandoned_lease_lapses_and_the_block_is_freed() -> None:
    """A receiver that acquired a lease and vanished: the lease lapses, then the TTL frees."""
    s = _conn("sender", buffer_ttl_s=0.5, transfer_timeout_s=0.5, lease_slack_s=0.2)
    client = SideChannelClient(2.0)
    try:
        s.put("0", "1", "orphan", torch.ones(1 << 16))
        lease = client.request(
            f"tcp://127.0.0.1:{s.zmq_port}", {"op": "acquire", "key": "orphan@0->1", "lease_s": 0.5}
        )
        assert lease["ok"] and lease["session"] == s.engine.session
        time.sleep(0.6)  # past the TTL, but the lease still protects the block
        assert s.pool.allocator.used > 0
        assert wait_until(lambda: s.pool.allocator.used == 0, 5)
    finally:
        client.close()
        s.close()


def test_factory_alias_and_selftest() -> None:
    c = OmniConnectorFactory.create_connector(
        ConnectorSpec("nixl", nixl_config("dual", pool_mib=4))
    )
    try:
        assert isinstance(c, NixlPullConnector) and c.health()["backend"] == "nixl"
    finally:
        c.close()
    result = selftest()
    assert result["ok"], result


def test_missing_nixl_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, mod, None)  # a fault that cannot be made real here
    with pytest.raises(BackendUnavailable, match=r"vllm-omni-kv\[nixl\]"):
        _conn("receiver")


def test_handshake_and_pulls_only_with_the_same_key() -> None:
    """With an auth key the side channel (and so the NIXL metadata) answers key holders only."""
    key = AuthKey(b"nixl-test-key-" + bytes(range(32)))
    other = AuthKey(b"nixl-other-key-" + bytes(range(32)))
    sender = _conn("sender", auth_key=key)
    good, wrong, bare = (
        _conn("receiver", auth_key=key),
        _conn("receiver", auth_key=other),
        _conn("receiver"),
    )
    try:
        t = torch.arange(1 << 14, dtype=torch.int32)
        _ok, _size, meta = sender.put("0", "1", "k", t)
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
        with pytest.raises(KVPayloadError, match="not authenticated"):
            wrong.get("0", "1", "k", md)
        with pytest.raises(KVPayloadError, match="requires an auth key"):
            bare._nixl.handshake(sender.engine.session)  # type: ignore[union-attr]
        got = good.get("0", "1", "k", md)  # the refused receivers took nothing
        assert got is not None
        with got[0] as buf:
            assert torch.equal(buf.to_tensor(), t)
        assert wait_until(lambda: sender.pool.allocator.used == 0, 5)
    finally:
        for c in (good, wrong, bare, sender):
            c.close()


def test_a_process_that_used_nixl_exits_cleanly() -> None:
    """NIXL's bundled libnl next to the system's crashed every process at exit (SIGSEGV)
    on hosts without RDMA devices; the engine keeps UCX's unused IB modules unloaded."""
    code = (
        "import sys\n"
        "from vllm_omni_kv.backends.nixl.connector import selftest\n"
        "sys.exit(0 if selftest()['ok'] else 3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


_IDLE = """
import json, sys, time
import torch
from vllm_omni_kv.backends.nixl.connector import NixlPullConnector
base = json.loads(sys.argv[1])
s = NixlPullConnector({**base, "role": "sender"})
r = NixlPullConnector({**base, "role": "receiver"})
_ok, _n, meta = s.put("0", "1", "k", {"t": torch.arange(1 << 16)})
got = r.get("0", "1", "k", meta)
assert got is not None and torch.equal(got[0]["t"], torch.arange(1 << 16))
time.sleep(0.5)
t0, c0 = time.monotonic(), time.process_time()
time.sleep(1.5)
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - t0}))
r.close()
s.close()
"""


def test_idle_agents_do_not_spin_a_core() -> None:
    """NIXL's Python API starts each agent's UCX progress thread with a zero poll
    timeout: it spun a whole core per agent while idle. Two idle connectors that have
    moved a payload use a small fraction of one core between moves."""
    cfg = {k: v for k, v in nixl_config("sender", pool_mib=8).items() if k != "role"}
    r = subprocess.run(
        [sys.executable, "-c", _IDLE, json.dumps(cfg)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    idle = json.loads(r.stdout.strip().splitlines()[-1])
    assert idle["cpu_s"] < 0.2 * idle["wall_s"], idle  # spinning: 2 CPU-seconds a second


def test_a_cache_registered_after_the_handshake_is_pulled_after_reloading() -> None:
    """NIXL reads only ranges it saw registered in the peer's metadata. A producer whose KV
    cache was registered after a consumer loaded that metadata (a pool pull came first):
    the consumer's first page pull loads it again, then reads; a range the producer never
    registered is refused before any transfer."""
    from vllm_omni_kv.backends.pull.selftest import pull_pages

    sender = _conn("sender", register_cache=True)
    receiver = _conn("receiver", register_cache=True)
    try:
        t = torch.arange(1024, dtype=torch.float32)
        _ok, _size, meta = sender.put("0", "1", "warm", t)
        got = receiver.get("0", "1", "warm", meta)  # loads the sender's metadata: its pool
        assert got is not None
        got[0].release()
        nixl = receiver._nixl
        assert nixl is not None
        assert len(nixl.handshake(sender.engine.session).spans) == 1
        assert pull_pages(sender, receiver, "cpu") == ("ok", True)  # its cache comes now
        assert len(nixl.handshake(sender.engine.session).spans) == 2  # pool + cache
        with pytest.raises(KVTransferError, match="not in the sender's registered memory"):
            nixl.read_many(sender.engine.session, [(receiver.base_ptr, 4096, 64)])
        # nor into memory of ours that is not registered (NIXL_ERR_NOT_FOUND on the H200)
        unregistered = torch.zeros(64, dtype=torch.uint8)
        with pytest.raises(KVTransferError, match="not in this agent's registered memory"):
            nixl.read_many(sender.engine.session, [(unregistered.data_ptr(), sender.base_ptr, 64)])
    finally:
        receiver.close()
        sender.close()


def test_a_device_read_on_this_host_is_a_warning_with_what_to_use() -> None:
    """NIXL READs of another process's GPU memory on one host ran over TCP on the H200
    (0.45-0.56 GB/s): the handshake warns and names the alternatives; host memory, or a
    peer on another host, is no warning."""
    from vllm_omni_kv.backends.nixl.memory import device_read_warning

    warned = device_read_warning(["DRAM:0", "VRAM:1"], "tcp://127.0.0.1:5555")
    assert warned is not None and "cuda_ipc" in warned and "memory_pool_device: cpu" in warned
    assert device_read_warning(["DRAM:0"], "tcp://127.0.0.1:5555") is None
    assert device_read_warning(["VRAM:0"], "tcp://192.0.2.7:5555") is None  # TEST-NET: not us


def test_the_transport_name_says_who_posts_the_moves() -> None:
    """The loads' transport label: under ``auto`` it follows the memory of the peers seen
    so far (device memory: their WRITE; host memory: our READ; both: both)."""
    from vllm_omni_kv.backends.nixl.memory import posting

    assert posting("auto", set()) == ""
    assert posting("auto", {"DRAM"}) == ""
    assert posting("auto", {"VRAM"}) == "/write"
    assert posting("auto", {"VRAM", "DRAM"}) == "/read+write"
    assert posting("read", {"VRAM"}) == ""
    assert posting("write", {"DRAM"}) == posting("write", set()) == "/write"


def test_the_handshake_log_names_who_posts_the_moves_out_of_each_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under ``auto`` device memory goes by the producer's WRITE and host memory by our
    READ; the log says so per memory, and warns only of device memory that is READ."""
    from vllm_omni_kv.backends.nixl.handshake import log_peer

    spans = [(0, 64, "DRAM", 0), (4096, 64, "VRAM", 1)]
    ours = [(0, 64, "DRAM", 0)]
    ep = "tcp://127.0.0.1:5555"
    with caplog.at_level(logging.INFO, logger="vllm_omni_kv"):
        log_peer("p", ep, spans, ours, "UCX", "auto")
    text = caplog.text
    assert "DRAM:0 by our READ, VRAM:1 by its WRITE" in text and "nixl_direction auto" in text
    assert "cuda_ipc" not in text  # the device memory is not READ: no warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_omni_kv"):
        log_peer("p", ep, spans, ours, "UCX", "read")
    assert "VRAM:1 by our READ" in caplog.text and "cuda_ipc" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_omni_kv"):
        log_peer("p", ep, spans, ours, "UCX", "write")
    assert "DRAM:0 by its WRITE, VRAM:1 by its WRITE" in caplog.text
    assert "cuda_ipc" not in caplog.text


def test_agents_made_at_once_leave_nixls_bindings_as_they_were() -> None:
    """Agents started by several threads at once (each swaps NIXL's config class for its
    constructor call) leave the binding module in place, so later agents, ours with
    ``nixl_progress_wait_us: 0`` and anyone else's, get NIXL's own config."""
    from vllm_omni_kv.backends.nixl.loader import import_nixl, make_agent

    agent_cls, config_cls, _sync = import_nixl()
    module = sys.modules[agent_cls.__init__.__module__]
    real = module.nixlBind
    agents: list[Any] = []

    def start(i: int) -> None:
        agents.append(make_agent(agent_cls, f"swap-{i}-{os.getpid()}", config_cls()))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(agents) == 4
    assert module.nixlBind is real
    cfg = real.nixlAgentConfig()
    cfg.pthrDelay = 0
    assert cfg.pthrDelay == 0


@pytest.mark.parametrize("bad", [{"data_size": -5}, {"data_size": "64"}, {"src_addr": "zz"}])
def test_a_hostile_block_address_is_refused_before_any_allocation(
    receivers: list[NixlPullConnector], bad: dict[str, Any]
) -> None:
    """The block a pull names (from ``kv_transfer_params`` or a sender's reply) is checked
    before the receiver allocates for it: an error, and no receive block kept."""
    s = _conn("sender")
    try:
        _ok, _size, meta = s.put("0", "1", "hostile", {"t": torch.arange(1 << 16)})
        r = receivers[1]
        used = r.pool.allocator.used
        with pytest.raises(KVTransferError, match="not a block"):
            r.open_stream("0", "1", "hostile", {**meta, **bad})
        assert r.pool.allocator.used == used
        got = r.get("0", "1", "hostile", meta)  # the real block is still served
        assert got is not None and torch.equal(got[0]["t"], torch.arange(1 << 16))
    finally:
        s.close()
