"""Mooncake Transfer Engine connector: allocator, pool, pulls by N receivers, failures, TTL."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _pause import pause
from _threads import errors_in_threads

from vllm_omni_kv.backends.pool import BufferAllocator, ManagedBuffer, MemoryPool
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient, SideChannelServer
from vllm_omni_kv.errors import (
    ConfigError,
    KVPayloadError,
    KVTransferCancelled,
    KVTransferError,
    KVTransferTimeout,
)
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.prelude import CHECKSUM_LINEAR

from ..conformance import SenderProcess, te_config, wait_until

# -- allocator / pool (no engine needed) -----------------------------------------------------


def test_allocator_first_fit_alignment_and_coalescing() -> None:
    a = BufferAllocator(64 * 4096, alignment=4096)
    x, y, z = a.alloc(1), a.alloc(4097), a.alloc(4096)
    assert (x, y, z) == (0, 4096, 3 * 4096)  # first fit, sizes rounded up to the alignment
    a.free(y)
    assert a.alloc(100) == 4096  # reuses the first hole that fits
    a.free(4096)
    a.free(x)
    a.free(z)
    assert a.free_blocks() == [(0, 64 * 4096)]  # neighbours coalesced back into one block
    assert a.used == 0 and a.num_allocations == 0


def test_allocator_loud_errors() -> None:
    a = BufferAllocator(16 * 4096)
    off = a.alloc(3 * 4096)
    a.free(off)
    with pytest.raises(KVTransferError, match="double free"):
        a.free(off)
    big = a.alloc(2 * 4096)
    with pytest.raises(KVTransferError, match="overlapping free.*4096"):
        a.free(big + 4096)
    with pytest.raises(KVTransferError, match="outside this pool"):
        a.free(1 << 30)
    with pytest.raises(KVTransferError, match=r"exhausted.*100000000 bytes"):
        a.alloc(100_000_000)
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ConfigError):
        BufferAllocator(4096, alignment=3000)


def test_allocator_thread_safety() -> None:
    a = BufferAllocator(256 * 4096)

    def churn(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(300):
            offs = [a.alloc(int(torch.randint(1, 3 * 4096, (1,), generator=g))) for _ in range(4)]
            for o in offs:
                a.free(o)

    errors = errors_in_threads(churn, 4)
    assert not errors, errors
    assert a.free_blocks() == [(0, 256 * 4096)]


def test_managed_buffer_views_release_and_context() -> None:
    pool = MemoryPool(1 << 20)
    with pool.alloc(64) as buf:
        assert isinstance(buf, ManagedBuffer) and buf.address == pool.base_ptr + buf.offset
        buf.as_tensor(torch.float32, (4, 4)).fill_(2.0)
        assert float(buf.tensor.view(torch.float32).sum()) == 32.0
        with pytest.raises(ValueError):
            buf.as_tensor(torch.float32, (100,))
    assert buf.released and pool.allocator.used == 0
    buf.release()  # idempotent
    with pytest.raises(KVTransferError, match="released"):
        _ = buf.tensor
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="not available"):
            MemoryPool(1 << 20, "cuda:0")
    with pytest.raises(ConfigError, match="memory_pool_device"):
        MemoryPool(1 << 20, "tpu")


def test_side_channel_timeout_and_bad_ops() -> None:
    from vllm_omni_kv.testing.net import free_port

    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True, "echo": m["x"]})
    client = SideChannelClient(timeout_s=0.5)
    try:
        assert client.request(server.endpoint, {"op": "x", "x": 3}) == {"ok": True, "echo": 3}
        reply = client.request(server.endpoint, {"op": "x"})  # handler raises KeyError
        assert reply["ok"] is False and "KeyError" in reply["error"]

        t0 = time.monotonic()
        with pytest.raises(KVTransferTimeout, match="no reply"):
            client.request(f"tcp://127.0.0.1:{free_port()}", {"op": "ping"})
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(KVTransferError, match="cannot bind"):
            SideChannelServer("127.0.0.1", server.port, lambda m: m)
    finally:
        client.close()
        server.close()


# -- with the real engine -----------------------------------------------------------------------


def _conn(role: str, **over: Any) -> Any:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    return MooncakeTransferEngineConnector(
        te_config(role, pool_mib=over.pop("pool_mib", 16), **over)
    )


@pytest.fixture(scope="module")
def sender() -> Iterator[Any]:
    c = _conn("sender", max_pulls=1)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _sender_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "sender" in request.fixturenames:
        s = request.getfixturevalue("sender")
        for key in ("k", "huge", "fits", "second", "obj"):
            s.cleanup(key)
        assert wait_until(lambda: s.pool.allocator.used == 0, 2)


@pytest.fixture(scope="module")
def receivers() -> Iterator[list[Any]]:
    rs = [_conn("receiver") for _ in range(3)]
    yield rs
    leaked = [r.pool.allocator.used for r in rs]
    assert leaked == [0, 0, 0], f"receiver pool blocks never released: {leaked}"
    for r in rs:
        r.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("case", ["full", "host_port", "default_sender", "rank"])
def test_metadata_cases(sender: Any, receivers: list[Any], case: str) -> None:
    t = torch.randn(1000)
    _ok, size, meta = sender.put("0", "1", "k", t)
    r = receivers[0]
    if case == "full":
        md = meta
    elif case == "host_port":
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
    elif case == "default_sender":
        r.update_sender_info(sender.host, sender.zmq_port)
        md = None
    else:
        r.update_sender_info(sender.host, sender.zmq_port, sender_rank=3)
        md = {"sender_rank": 3}
    got = r.get("0", "1", "k", md)
    assert got is not None and got[1] == size
    with got[0] as buf:
        assert torch.equal(buf.to_tensor(), t)
    assert wait_until(lambda: sender.pool.allocator.used == 0, 2), "block not freed after its pull"


@pytest.mark.mooncake
def test_receivers_refuse_frames_without_digests_whatever_the_sender_says(
    receivers: list[Any],
) -> None:
    """A sender with ``frame_checksum: false`` packs frames without digests: a receiver
    refuses them (its ``require_digests`` defaults to true) and frees its block; one that
    sets ``require_digests: false`` takes them."""
    plain = _conn("sender", max_pulls=0, frame_checksum=False)
    lax = _conn("receiver", require_digests=False)
    try:
        obj = {"t": torch.arange(50_000, dtype=torch.int32), "name": "x"}
        _ok, _size, meta = plain.put("0", "1", "obj", obj)
        with pytest.raises(KVPayloadError, match="no checksum.*require_digests"):
            receivers[0].open_stream("0", "1", "obj", meta)
        assert receivers[0].pool.allocator.used == 0
        got = lax.get("0", "1", "obj", meta)
        assert got is not None and torch.equal(got[0]["t"], obj["t"]) and got[0]["name"] == "x"
    finally:
        lax.close()
        plain.close()


@pytest.mark.mooncake
def test_frames_packed_on_a_device_are_verified_by_host_pool_receivers(
    sender: Any, receivers: list[Any]
) -> None:
    """A put through the device path (its stream operations recorded on host tensors) packs
    linear digests; a host-pool receiver checks them: the intact frame loads, one flipped
    byte in the sender's block fails the load."""
    obj = {"t": torch.arange(200_000, dtype=torch.int32), "name": "d"}
    for flip in (False, True):
        with device_order.installed("cpu", RecordingStreams()):
            _ok, size, meta = sender.put("0", "1", "obj", obj)
        block = (ctypes.c_char * size).from_address(meta["src_addr"])
        assert codec.read_prelude(bytes(block[:32]), size).alg == CHECKSUM_LINEAR
        if not flip:
            got = receivers[0].get("0", "1", "obj", meta)
            assert got is not None and torch.equal(got[0]["t"], obj["t"])
            continue
        block[size // 2] = bytes([block[size // 2][0] ^ 0x40])
        with receivers[0].open_stream("0", "1", "obj", meta) as stream:
            with pytest.raises(KVPayloadError, match="chunk .* checksum mismatch"):
                for _ in stream.load(None, time.monotonic() + 20):
                    pass


@pytest.mark.mooncake
def test_pool_exhaustion_is_a_clear_error(sender: Any) -> None:
    with pytest.raises(KVTransferError, match="memory pool exhausted.*memory_pool_size"):
        sender.put("0", "1", "huge", torch.empty(20 << 20, dtype=torch.uint8))
    ok, _s, _m = sender.put("0", "1", "fits", torch.empty(8 << 20, dtype=torch.uint8))
    assert ok
    with pytest.raises(KVTransferError, match="exhausted"):
        sender.put("0", "1", "second", torch.empty(10 << 20, dtype=torch.uint8))
    sender.cleanup("fits")
    assert sender.pool.allocator.used == 0
    assert sender.put("0", "1", "second", torch.empty(10 << 20, dtype=torch.uint8))[0]


@pytest.mark.mooncake
def test_one_sender_many_receivers(receivers: list[Any]) -> None:
    s = _conn("sender", max_pulls=3)
    try:
        t = torch.arange(5000, dtype=torch.int32)
        _ok, _size, meta = s.put("0", "1", "shared", t)
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
        for r in receivers:
            got = r.get("0", "1", "shared", md)
            assert got is not None
            with got[0] as buf:
                assert torch.equal(buf.to_tensor(), t)
        assert receivers[0].get("0", "1", "shared", md) is None  # a 4th pull: exhausted
        assert wait_until(lambda: s.pool.allocator.used == 0, 2)
    finally:
        s.close()


@pytest.mark.mooncake
def test_retain_and_release_explicitly(receivers: list[Any]) -> None:
    s = _conn("sender", max_pulls=0)  # kept until released
    try:
        _ok, _size, meta = s.put("0", "1", "kept", b"payload" * 500)
        for _ in range(2):
            for r in receivers:
                got = r.get("0", "1", "kept", meta)
                assert got is not None
                got[0].release()
        s.release("0", "1", "kept")
        assert receivers[0].get("0", "1", "kept", meta) is None
        assert s.pool.allocator.used == 0
        s1 = _conn("sender", max_pulls=1)
        try:
            _ok, _size, meta = s1.put("0", "1", "x", b"y" * 100)
            assert s1.retain("0", "1", "x", pulls=1)
            md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
            for r in receivers[:2]:
                got = r.get("0", "1", "x", md)
                assert got is not None
                got[0].release()
            assert receivers[2].get("0", "1", "x", md) is None
        finally:
            s1.close()
    finally:
        s.close()


@pytest.mark.mooncake
def test_ttl_expiry_frees_unpulled_buffers(receivers: list[Any]) -> None:
    s = _conn("sender", buffer_ttl_s=0.3)
    try:
        _ok, _size, meta = s.put("0", "1", "stale", torch.ones(1 << 16))
        assert s.pool.allocator.used > 0
        assert wait_until(lambda: s.pool.allocator.used == 0, 3), "TTL did not free the buffer"
        assert s.health()["expired"] == 1
        assert receivers[0].get("0", "1", "stale", meta) is None
    finally:
        s.close()


@pytest.mark.mooncake
def test_receiver_dies_mid_pull_block_is_reclaimed() -> None:
    """A receiver that acquired a lease and vanished: the lease lapses, then the TTL frees."""
    s = _conn("sender", buffer_ttl_s=0.5, transfer_timeout_s=0.5, lease_slack_s=0.2)
    client = SideChannelClient(2.0)
    try:
        s.put("0", "1", "orphan", torch.ones(1 << 16))
        lease = client.request(
            f"tcp://127.0.0.1:{s.zmq_port}", {"op": "acquire", "key": "orphan@0->1", "lease_s": 0.5}
        )
        assert lease["ok"]
        t0 = time.monotonic()
        time.sleep(0.6)  # past the TTL, but the lease still protects the block
        assert s.pool.allocator.used > 0
        assert wait_until(lambda: s.pool.allocator.used == 0, 3)
        assert time.monotonic() - t0 < 3.0
    finally:
        client.close()
        s.close()


@pytest.mark.mooncake
@pytest.mark.slow
def test_sender_dies_bounded_failure() -> None:
    proc = SenderProcess(te_config("sender", pool_mib=16))
    r = _conn("receiver", side_channel_timeout_s=1.0, transfer_timeout_s=2.0)
    try:
        meta = proc.call(op="put", key="k1", data=torch.ones(4096))["meta"]
        meta2 = proc.call(op="put", key="k2", data=torch.ones(4096))["meta"]
        proc.proc.kill()
        proc.proc.join(10)
        t0 = time.monotonic()
        assert r.get("0", "1", "k1", meta) is None  # full metadata: the pull itself fails
        partial = {"source_host": meta2["source_host"], "source_port": meta2["source_port"]}
        assert r.get("0", "1", "k2", partial) is None  # side channel: no reply in time
        assert time.monotonic() - t0 < 6.0
        assert r.health()["failures"] + r.health()["timeouts"] >= 2
        assert r.pool.allocator.used == 0
        r.raise_on_timeout = True  # opt-in: report the timeout as an exception instead
        with pytest.raises(KVTransferTimeout, match="no reply"):
            r.get("0", "1", "k2", partial)
    finally:
        r.close()
        proc.stop()


@contextlib.contextmanager
def _sender_and_receiver(
    pool_mib: int, **receiver: Any
) -> Iterator[tuple[SenderProcess, Any, int]]:
    """A sender process, an in-process receiver and the sender's pid; the sender is always
    resumed (it may be SIGSTOPped) and both are always stopped."""
    proc = SenderProcess(te_config("sender", pool_mib=pool_mib))
    r = _conn("receiver", pool_mib=pool_mib, **receiver)
    pid = proc.proc.pid
    assert pid is not None
    try:
        yield proc, r, pid
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test may have killed it
            os.kill(pid, signal.SIGCONT)
        r.close()
        proc.stop()


@pytest.mark.mooncake
@pytest.mark.slow
def test_stalled_sender_is_bounded_by_transfer_timeout() -> None:
    """SIGSTOP the sender between put and pull: the pull must give up, not hang."""
    with _sender_and_receiver(64, side_channel_timeout_s=1.0, transfer_timeout_s=1.5) as (
        proc,
        r,
        pid,
    ):
        meta = proc.call(op="put", key="big", data=torch.ones(8 << 20, dtype=torch.uint8))["meta"]
        pause(pid)
        t0 = time.monotonic()
        assert r.get("0", "1", "big", meta) is None
        assert time.monotonic() - t0 < 5.0
        assert r.health()["timeouts"] == 1, r.health()  # the pull stalled and was cut off


@pytest.mark.mooncake
@pytest.mark.slow
def test_pull_after_a_stall_succeeds_on_a_fresh_connection() -> None:
    """A stalled pull gives up; once the sender runs again the same key is pulled intact."""
    data = torch.arange(8 << 20, dtype=torch.int32).to(torch.uint8)
    with _sender_and_receiver(64, side_channel_timeout_s=2.0, transfer_timeout_s=2.0) as (
        proc,
        r,
        pid,
    ):
        meta = proc.call(op="put", key="again", data=data)["meta"]
        pause(pid)
        assert r.get("0", "1", "again", meta) is None
        os.kill(pid, signal.SIGCONT)
        got = None
        deadline = time.monotonic() + 20
        endpoint = {k: meta[k] for k in ("source_host", "source_port")}
        while got is None and time.monotonic() < deadline:
            got = r.get("0", "1", "again", endpoint)
        assert got is not None, r.health()
        buf, size = got
        assert size == data.numel() and torch.equal(buf.tensor[:size], data)
        buf.release()


@pytest.mark.mooncake
@pytest.mark.slow
def test_acquire_that_timed_out_does_not_block_the_retry() -> None:
    """A sender stuck past the side-channel timeout still grants the acquire later; that
    orphan lease must not make the key look exhausted (max_pulls=1) to the retry."""
    data = torch.arange(1 << 16, dtype=torch.int32)
    # a long lease: without holder-scoped leases the retry would wait ~35 s for it to lapse
    with _sender_and_receiver(16, side_channel_timeout_s=1.0, transfer_timeout_s=30.0) as (
        proc,
        r,
        _pid,
    ):
        meta = proc.call(op="put", key="slow", data=data)["meta"]
        endpoint = {k: meta[k] for k in ("source_host", "source_port")}
        proc.call(op="put", key="first", data=data)
        first = r.get("0", "1", "first", endpoint)  # this thread has its holder id now
        assert first is not None
        first[0].release()
        proc.call(op="hold_gil", seconds=2.0)
        time.sleep(0.2)  # the sender is stuck by now (its socket to us is warm)
        t0 = time.monotonic()
        assert r.get("0", "1", "slow", endpoint) is None  # no reply within 1 s...
        assert r.health()["timeouts"] == 1
        assert wait_until(lambda: proc.call(op="health")["health"]["active_leases"] == 1, 10)
        assert time.monotonic() - t0 < 5.0  # ...but granted once the sender ran again
        got = r.get("0", "1", "slow", endpoint)
        assert got is not None, r.health()
        buf, size = got
        assert torch.equal(buf.tensor[:size].view(torch.int32), data)
        buf.release()
        # that was the one allowed pull: the block is freed, no lease is left behind
        health = proc.call(op="health")["health"]
        assert health["exposed_blocks"] == 0 and health["active_leases"] == 0, health


def test_exposure_table_holder_replaces_its_own_lease() -> None:
    from vllm_omni_kv.backends.pull.exposure import ExposureTable

    pool = MemoryPool(1 << 20)
    t = ExposureTable(ttl_s=60, max_pulls=1)
    t.add("k", pool.alloc(64), 64, fast=True)
    first = t.acquire("k", 30, holder="a")
    assert first["ok"]
    assert t.acquire("k", 30, holder="b") == {"ok": False, "reason": "exhausted"}
    second = t.acquire("k", 30, holder="a")  # "a" gave up on its first attempt
    assert second["ok"] and second["lease"] != first["lease"]
    assert "token" not in first  # acquire never discloses the block's token
    assert t.release("", first["lease"], success=True)["ok"] is False
    assert t.counts()["active_leases"] == 1
    assert t.release("", second["lease"], success=True) == {"ok": True}
    assert t.counts()["exposed_blocks"] == 0  # the one allowed pull is done: freed
    assert pool.allocator.used == 0


@pytest.mark.mooncake
def test_tcp_progress_timeout_sets_mooncake_env() -> None:
    """``tcp_progress_timeout_s`` reaches Mooncake unless the user set the variable."""
    code = (
        "import os\n"
        "os.environ.pop('MC_TCP_PROGRESS_TIMEOUT_SEC', None)\n"
        "from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector as C\n"
        "c = C({'role': 'receiver', 'protocol': 'tcp', 'host': '127.0.0.1',\n"
        "       'memory_pool_size': 1 << 20, 'tcp_progress_timeout_s': 2})\n"
        "print('MC=' + os.environ['MC_TCP_PROGRESS_TIMEOUT_SEC'])\n"
        "c.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MC_TCP_PROGRESS_TIMEOUT_SEC"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert "MC=2" in out.stdout, out.stderr[-2000:]
    env["MC_TCP_PROGRESS_TIMEOUT_SEC"] = "7"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("os.environ.pop('MC_TCP_PROGRESS_TIMEOUT_SEC', None)", ""),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "MC=7" in out.stdout, out.stderr[-2000:]


@pytest.mark.mooncake
def test_zero_copy_put_of_own_buffer(receivers: list[Any]) -> None:
    s = _conn("sender")
    try:
        buf = s.pool.alloc(4096)
        buf.tensor.fill_(7)
        _ok, size, meta = s.put("0", "1", "zc", buf)
        assert meta["src_addr"] == buf.address and size == 4096  # exposed in place, no copy
        got = receivers[0].get("0", "1", "zc", meta)
        assert got is not None
        with got[0] as out:
            assert bool((out.tensor == 7).all())
        assert wait_until(lambda: s.pool.allocator.used == 0, 2)  # the connector released it
    finally:
        s.close()


@pytest.mark.mooncake
def test_object_views_hold_the_block_until_dropped(sender: Any, receivers: list[Any]) -> None:
    r = receivers[0]
    before = r.pool.allocator.used
    _ok, _size, meta = sender.put("0", "1", "obj", {"t": torch.randn(256)})
    got = r.get("0", "1", "obj", meta)
    assert got is not None and r.pool.allocator.used > before
    view = got[0]["t"]
    del got
    assert r.pool.allocator.used > before  # the tensor view still lives in the block
    del view
    assert r.pool.allocator.used == before


@pytest.mark.mooncake
def test_roles_and_ports(receivers: list[Any]) -> None:
    with pytest.raises(KVTransferError, match="role is 'receiver'.*cannot put"):
        receivers[0].put("0", "1", "k", b"x")
    s = _conn("sender")
    try:
        with pytest.raises(KVTransferError, match="cannot get"):
            s.get("0", "1", "k", None)
        with pytest.raises(KVTransferError, match="update_sender_info"):
            receivers[1].get("0", "1", "k", None)
        info = s.get_connection_info()
        assert info["zmq_port"] == s.zmq_port and info["session"].endswith(str(info["rpc_port"]))
    finally:
        s.close()
    from vllm_omni_kv.backends.pull.side_channel import sender_zmq_port
    from vllm_omni_kv.kvcache.kv_utils import kv_zmq_port

    cfg = {"zmq_port": 20000, "from_stage": 2, "local_rank": 3, "replica_id": 0}
    assert sender_zmq_port(cfg) == kv_zmq_port(20000, 2, 3, 0)
    # one rank->port rule everywhere: rank r of a sender listens on base + 16 * r
    assert sender_zmq_port({"zmq_port": 20000, "local_rank": 1}) == 20016
    assert sender_zmq_port({"zmq_port": 20000, "local_rank": 3}) == 20048
    with pytest.raises(ConfigError):
        _conn("bogus-role")


@pytest.mark.mooncake
def test_selftest() -> None:
    from vllm_omni_kv.backends.pull.mooncake import selftest

    res = selftest()
    assert res["ok"], res["detail"]


@pytest.mark.parametrize(
    ("module", "factory_name"),
    [("mooncake.engine", "mooncake_te"), ("mooncake.store", "mooncake_store")],
)
def test_missing_mooncake_names_the_package(
    monkeypatch: pytest.MonkeyPatch, module: str, factory_name: str
) -> None:
    from vllm_omni_kv.backends.factory import OmniConnectorFactory
    from vllm_omni_kv.backends.spec import ConnectorSpec
    from vllm_omni_kv.errors import BackendUnavailable

    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` fail
    with pytest.raises(BackendUnavailable, match="pip install mooncake-transfer-engine-non-cuda"):
        extra = te_config("dual") if factory_name == "mooncake_te" else {}
        OmniConnectorFactory.create_connector(ConnectorSpec(factory_name, extra))


# -- a hostile side-channel client ------------------------------------------------------------


def test_side_channel_survives_malformed_oversized_and_flooding_clients() -> None:
    import msgpack

    from vllm_omni_kv.backends.pull.side_channel import MAX_REQUEST

    from .raw_peer import raw_request

    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True}, max_rate=50)
    client = SideChannelClient(timeout_s=1.0)
    try:
        for junk, why in ((b"\xc1\xc1", "not valid msgpack"), (msgpack.packb([1, 2]), "a map")):
            reply = msgpack.unpackb(raw_request(server.endpoint, junk) or b"\x80")
            assert reply["ok"] is False and why in reply["error"]
        # over MAX_REQUEST: the server closes the connection, it does not answer it
        assert raw_request(server.endpoint, b"\x00" * (MAX_REQUEST + 1)) is None
        replies = [client.request(server.endpoint, {"op": "ping"}) for _ in range(200)]
        busy = sum(r.get("reason") == "busy" for r in replies)
        assert 50 <= busy <= 150  # beyond ~50 requests at once: busy, not queued
        # ending a pull is answered even now
        assert client.request(server.endpoint, {"op": "release"}) == {"ok": True}
        time.sleep(0.2)
        assert client.request(server.endpoint, {"op": "ping"}) == {"ok": True}
    finally:
        client.close()
        server.close()


@pytest.mark.mooncake
def test_hostile_leases_are_bounded_and_releases_need_the_lease(receivers: list[Any]) -> None:
    from vllm_omni_kv.backends.keys import edge_key

    s = _conn("sender", max_pulls=1, buffer_ttl_s=1.5, lease_slack_s=0.1)
    client = SideChannelClient(timeout_s=2.0)
    endpoint = f"tcp://{s.host}:{s.zmq_port}"
    try:
        t = torch.arange(4096, dtype=torch.int32)
        _ok, _size, meta = s.put("0", "1", "k", t)
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
        key = edge_key("k", "0", "1")
        for bad in (float("inf"), float("nan"), -1, "forever"):
            reply = client.request(endpoint, {"op": "acquire", "key": key, "lease_s": bad})
            assert reply["ok"] is False and "lease_s" in reply["error"]
        grab = client.request(endpoint, {"op": "acquire", "key": key, "lease_s": 1e9})
        assert grab["ok"] and "token" not in grab  # granted for at most buffer_ttl_s (+ slack)
        for forged in ({}, {"lease": ""}, {"lease": "0" * 32}, {"token": "0" * 32}):
            reply = client.request(endpoint, {"op": "release", **forged})
            assert reply["ok"] is False
        assert receivers[0].get("0", "1", "k", md) is None  # the one pull is leased away
        time.sleep(1.5 + 0.1 + 0.6)  # the hostile lease lapses; the TTL frees the buffer
        assert wait_until(lambda: s.pool.allocator.used == 0, 3), "a hostile lease pinned it"
    finally:
        client.close()
        s.close()


@pytest.mark.mooncake
@pytest.mark.slow
def test_a_load_that_fails_mid_pull_frees_its_receive_block_at_once() -> None:
    """The sender dies between the stream's open (its head pulled) and the load of its
    chunks: the load fails, and closing the stream gives the receive block back once no
    read into it runs, also while the failure (its traceback holds the stream) is kept
    alive, as a caller that logs or stores it does. Before, the block waited for the
    garbage collector, and a killed producer's frame held a consumer's pool for minutes."""
    with _sender_and_receiver(64, side_channel_timeout_s=1.0, transfer_timeout_s=2.0) as (
        proc,
        r,
        pid,
    ):
        payload = {"kv": torch.arange(4 << 20, dtype=torch.int32).to(torch.uint8)}
        meta = proc.call(op="put", key="frame", data=payload)["meta"]
        stream = r.open_stream("0", "1", "frame", meta)
        assert stream is not None and r.pool.allocator.used > 0
        os.kill(pid, signal.SIGKILL)
        proc.proc.join(10)
        kept: list[BaseException] = []
        try:
            with stream:
                for _ in stream.load(None, time.monotonic() + 10):
                    pass
        except KVTransferError as e:  # PullFailed, or a timeout
            kept.append(e)
        assert kept, "the load of a dead sender's frame did not fail"
        assert wait_until(lambda: r.pool.allocator.used == 0, 10), r.pool.allocator.used


class _Calls:
    """The engine's binding, with the name of every method the adapter reaches recorded."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding
        self.names: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.names.append(name)
        return getattr(self._binding, name)


@pytest.mark.mooncake
def test_a_short_read_is_polled_and_batches_are_exact() -> None:
    """A read of up to four ranges (``read``, ``read_many``: a frame's head and tail, every
    small pull) is submitted and polled with sleeps, never through the binding's
    synchronous calls, which poll without pause and kept the engine's own I/O threads off
    the cores (3 ms reads on a busy host). Longer batches still arrive exactly; a read of
    unregistered memory fails with the engine's error, not at the 30 s bound."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeEngine

    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    tx = MooncakeEngine("127.0.0.1", protocol="tcp")
    rx = MooncakeEngine("127.0.0.1", protocol="tcp")
    try:
        tx.register(src.data_ptr(), src.numel())
        rx.register(dst.data_ptr(), dst.numel())
        calls = rx.engine = _Calls(rx.engine)
        s, d = src.data_ptr(), dst.data_ptr()
        rx.read(tx.session, d, s + 4096, 24 << 10)
        rx.read_many(tx.session, [(d + (64 << 10), s, 1000), (d + (96 << 10), s + 8192, 500)])
        assert torch.equal(dst[: 24 << 10], src[4096 : 4096 + (24 << 10)])
        assert torch.equal(dst[64 << 10 : (64 << 10) + 1000], src[:1000])
        assert torch.equal(dst[96 << 10 : (96 << 10) + 500], src[8192 : 8192 + 500])
        assert "batch_transfer_async_read" in calls.names
        assert not {"transfer_sync_read", "batch_transfer_sync_read"} & set(calls.names)

        dst.zero_()
        ranges = [(d + i * 8192, s + (127 - i) * 8192, 4096) for i in range(100)]
        rx.read_many(tx.session, ranges)
        for i in range(100):
            got = dst[i * 8192 : i * 8192 + 4096]
            assert torch.equal(got, src[(127 - i) * 8192 : (127 - i) * 8192 + 4096])

        dst.zero_()  # single reads from several threads at once (the pull threads)

        def reads(t: int) -> None:
            for i in range(t, 128, 4):
                rx.read(tx.session, d + i * 8192, s + i * 8192, 8192)

        errors = errors_in_threads(reads, 4)
        assert not errors and torch.equal(dst, src), errors

        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="Mooncake"):
            rx.read(tx.session, d, s + (8 << 20), 4096)  # past the registered buffer
        assert time.monotonic() - t0 < 10
    finally:
        rx.close()
        tx.close()


class _Refusing:
    """A binding whose asynchronous submit refuses (a peer's cached segment gone stale, as a
    real one cannot be made here: P2PHANDSHAKE gives a restarted peer a new port), while its
    synchronous read, which handshakes the peer again, succeeds."""

    def __init__(self, refused: int) -> None:
        self.refused, self.sync_reads = refused, 0

    def batch_transfer_async_read(self, *_a: Any) -> int:
        return self.refused

    def transfer_check_status(self, _bid: int) -> int:
        raise AssertionError("a batch that was not submitted must not be polled")

    def batch_transfer_sync_read(self, *_a: Any) -> int:
        self.sync_reads += 1
        return 0


@pytest.mark.parametrize("refused", [0, (1 << 64) - 1])
def test_a_read_the_binding_refuses_to_submit_goes_through_its_synchronous_read(
    refused: int,
) -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeEngine

    eng = object.__new__(MooncakeEngine)
    eng.engine, eng._polled = _Refusing(refused), True
    eng.read("127.0.0.1:1", 1 << 20, 2 << 20, 4096)
    eng.read_many("127.0.0.1:1", [(1 << 20, 2 << 20, 4096), (3 << 20, 4 << 20, 4096)])
    assert eng.engine.sync_reads == 2


class _Slow:
    """A binding whose one-range reads run until ``ends_at`` (a transfer that outlives the
    read's bound, as a real one does only over a slow link) and whose submit raises for
    a range it cannot take (a remote address past 64 bits, as pybind11 refuses it)."""

    def __init__(self, ends_at: float) -> None:
        self.ends_at, self.polls = ends_at, {}  # batch id -> polls

    def batch_transfer_async_read(self, _s: str, _l: Any, remote: list[int], _n: Any) -> int:
        if remote[0] >= 1 << 64:
            raise TypeError("batch_transfer_async_read(): incompatible function arguments")
        bid = 1000 + len(self.polls)
        self.polls[bid] = 0
        return bid

    def transfer_check_status(self, bid: int) -> int:
        self.polls[bid] += 1
        return 1 if time.monotonic() >= self.ends_at else 0


def _slow_engine(ends_in: float) -> Any:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeEngine

    eng = object.__new__(MooncakeEngine)
    eng.engine, eng._polled = _Slow(time.monotonic() + ends_in), True
    return eng


def test_a_polled_read_never_returns_while_its_transfer_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A transfer still running past the read's bound is waited for to its end, with a
    warning: the caller frees the destination once the read returns, so a read that
    raised while its transfer ran would let the destination be reused under it."""
    from vllm_omni_kv.backends.pull import mooncake

    monkeypatch.setattr(mooncake, "_sync_timeout_s", lambda _n: 0.1)
    eng = _slow_engine(0.6)
    t0 = time.monotonic()
    eng.read_many("127.0.0.1:1", [(1 << 20, 2 << 20, 4096), (3 << 20, 4 << 20, 4096)])
    assert time.monotonic() - t0 >= 0.55
    assert "still runs" in caplog.text


def test_a_submit_that_raises_waits_for_the_ranges_already_in_flight() -> None:
    """The second range's submit raises: the first, already in flight, is polled to its
    end (and so freed by the binding) before the error reaches the caller."""
    eng = _slow_engine(0.3)
    t0 = time.monotonic()
    with pytest.raises(TypeError):
        eng.read_many("127.0.0.1:1", [(1 << 20, 2 << 20, 4096), (3 << 20, 1 << 64, 4096)])
    assert time.monotonic() - t0 >= 0.25
    assert list(eng.engine.polls) == [1000] and eng.engine.polls[1000] > 1


@pytest.mark.mooncake
@pytest.mark.slow
def test_a_cancelled_raw_pull_keeps_its_block_until_the_read_ends() -> None:
    """A raw (fast-path) pull is cancelled while its engine read stalls (the sender
    SIGSTOPped): the load raises ``KVTransferCancelled``, and closing the stream does not
    give the receive block back while the read may still write into it (the next
    allocation would get it); once the read ends, it is freed."""
    with _sender_and_receiver(64, side_channel_timeout_s=1.0, transfer_timeout_s=30.0) as (
        proc,
        r,
        pid,
    ):
        meta = proc.call(op="put", key="big", data=torch.ones(8 << 20, dtype=torch.uint8))["meta"]
        used = r.pool.allocator.used
        stream = r.open_stream("0", "1", "big", meta)
        assert stream is not None
        pause(pid)
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        with pytest.raises(KVTransferCancelled):
            for _ in stream.load(None, time.monotonic() + 30, cancel):
                pass
        stream.close()
        assert r.pool.allocator.used > used, "the block was freed under a running read"
        os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: r.pool.allocator.used == used, 30), r.health()
