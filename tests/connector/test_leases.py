"""Payload leases (:mod:`vllm_omni_kv.connector.handoff`): a producer's timer withdraws unconsumed payloads after ``send_ttl``
(no engine step needed), and a waiting consumer extends them (real /dev/shm, real
processes, real Mooncake TE over loopback)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _mp import CTX
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector
from vllm_omni_kv.backends.shm import arena as shm_arena
from vllm_omni_kv.backends.shm.connector import index_name
from vllm_omni_kv.connector.handoff import ProducerHandoffs, extend_every
from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector
from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.transfer.session import SessionPolicy, TransferSession

TTL = 1.0  # send_ttl of these tests
WAIT = 60.0


def _payload(seed: int) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(256, 4, 64, generator=g) for _ in range(2)]
    v = [torch.randn(256, 4, 64, generator=g) for _ in range(2)]
    return KVCacheTransferData("r", {"key_cache": k, "value_cache": v}, [0], {"seed": seed})


def _until(cond: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _same(obj: dict[str, Any], ref: KVCacheTransferData) -> bool:
    return all(
        torch.equal(a, b)
        for name in ("key_cache", "value_cache")
        for a, b in zip(obj["layer_blocks"][name], ref.layer_blocks[name], strict=True)
    )


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return f"ls{os.getpid()}_{request.node.name[:40]}"


@pytest.fixture
def shm_producer(ns: str) -> Iterator[tuple[TransferSession, ProducerHandoffs]]:
    conn = SharedMemoryConnector({"namespace": ns})
    session = TransferSession(conn, "0", "1", SessionPolicy())
    leases = ProducerHandoffs(session, TTL)
    yield session, leases
    leases.close()
    conn.close()


def _send(session: TransferSession, leases: ProducerHandoffs, key: str, seed: int) -> None:
    _n, parts = session.publish(key, _payload(seed))
    leases.published(f"req-{key}", key, parts=parts)


def test_idle_producer_withdraws_an_unconsumed_payload_after_send_ttl(
    ns: str, shm_producer: tuple[TransferSession, ProducerHandoffs]
) -> None:
    session, leases = shm_producer
    _send(session, leases, "k", 1)
    idx = index_name(ns, "0", "1", "k")
    assert idx in shm_arena.namespace_files(ns)
    # nothing else happens in this process: only the lease thread can withdraw it
    assert _until(lambda: leases.expired == 1)
    assert idx not in shm_arena.namespace_files(ns) and len(leases) == 0
    assert session.held_payloads()[0] == 0
    with SharedMemoryConnector({"namespace": ns}) as rx:
        assert rx.get("0", "1", "k") is None  # the consumer finds nothing: it recomputes


def test_consumed_payload_is_not_counted_as_expired(
    ns: str, shm_producer: tuple[TransferSession, ProducerHandoffs]
) -> None:
    session, leases = shm_producer
    _send(session, leases, "k", 2)
    with SharedMemoryConnector({"namespace": ns}) as rx:
        got = rx.get("0", "1", "k")
        assert got is not None and _same(got[0], _payload(2))
        del got
    assert _until(lambda: len(leases) == 0)
    assert leases.expired == 0


def _extend_then_load(ns: str, key: str, hold_s: float, ready: Any, go: Any, q: Any) -> None:
    """A consumer that waits ``hold_s`` (its request has no blocks yet), extending the
    payload's lease as the worker does, then loads it."""
    conn = SharedMemoryConnector({"namespace": ns})
    session = TransferSession(conn, "0", "1", SessionPolicy())
    try:
        ready.set()
        go.wait(WAIT)
        end = time.monotonic() + hold_s
        extended = 0
        while time.monotonic() < end:
            extended += session.extend(key, None, TTL)
            time.sleep(extend_every(TTL))
        got = conn.get("0", "1", key)
        ok = got is not None and _same(got[0], _payload(3))
        q.put((extended, ok))
        del got
    finally:
        conn.close()


def test_a_waiting_consumer_keeps_the_payload_alive_beyond_send_ttl(
    ns: str, shm_producer: tuple[TransferSession, ProducerHandoffs]
) -> None:
    session, leases = shm_producer
    ready, go, q = CTX.Event(), CTX.Event(), CTX.Queue()
    p = CTX.Process(target=_extend_then_load, args=(ns, "k", 4 * TTL, ready, go, q))
    p.start()
    try:
        assert ready.wait(WAIT)
        _send(session, leases, "k", 3)
        go.set()
        extended, ok = q.get(timeout=WAIT)
    finally:
        p.join(30)
    assert extended >= 3 and ok  # still there after 4 x send_ttl, and bit-exact
    assert _until(lambda: len(leases) == 0)
    assert leases.expired == 0


def test_extension_stops_and_the_lease_runs_out(
    ns: str, shm_producer: tuple[TransferSession, ProducerHandoffs]
) -> None:
    session, leases = shm_producer
    _send(session, leases, "k", 4)
    with SharedMemoryConnector({"namespace": ns}) as rx:
        rx_session = TransferSession(rx, "0", "1", SessionPolicy())
        assert rx_session.extend("k", None, 2 * TTL) == 1
        held = session.lease_until("k")
        assert held is not None and held > time.monotonic() + TTL  # the producer sees it
        assert _until(lambda: leases.expired == 1)  # ... and expires it once it ran out
        assert rx.get("0", "1", "k") is None
        assert rx_session.extend("k", None, TTL) == 0  # nothing left to extend


def test_shm_ttl_seconds_respects_an_extension(ns: str) -> None:
    # the backend's own TTL (ttl_seconds, checked on put) honours a consumer's extension too
    with (
        SharedMemoryConnector({"namespace": ns, "ttl_seconds": 0.5}) as tx,
        SharedMemoryConnector({"namespace": ns}) as rx,
    ):
        tx.put("0", "1", "kept", _payload(5))
        tx.put("0", "1", "dropped", _payload(6))
        assert rx.extend("0", "1", "kept", 30.0)
        time.sleep(1.2)
        tx._last_sweep = 0.0
        tx.put("0", "1", "trigger", _payload(7))  # runs the TTL check
        assert tx.health()["unconsumed"] == 2  # "kept" and "trigger"
        got = rx.get("0", "1", "kept")
        assert got is not None and _same(got[0], _payload(5))
        assert rx.get("0", "1", "dropped") is None
        del got
        assert rx.get("0", "1", "trigger") is not None


def test_leases_expired_is_a_counter_and_a_prometheus_metric() -> None:
    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)

        return Bound

    reg = CollectorRegistry()
    prom = OmniKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},  # type: ignore[dict-item]
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert prom is not None
    a, b = OmniKVConnectorStats(), OmniKVConnectorStats()
    a.record_leases_expired(2)
    b.record_leases_expired(1)
    b.record_notices_dropped(4)
    agg = a.aggregate(b)
    assert isinstance(agg, OmniKVConnectorStats) and agg.reduce()["leases_expired"] == 3
    assert agg.reduce()["notices_dropped"] == 4
    prom.observe(agg.data, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:omnikv_leases_expired_total", labels) == 3
    assert reg.get_sample_value("vllm:omnikv_notices_dropped_total", labels) == 4
    assert not a.is_empty() and a.take() is not None and a.is_empty()


# -- Mooncake Transfer Engine: the extend op of the side channel ---------------------------
def _te(role: str, **over: Any) -> Any:
    pytest.importorskip("mooncake")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    cfg: dict[str, Any] = {
        "role": role,
        "host": "127.0.0.1",
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "zmq_port": 0,
        "memory_pool_size": 64 << 20,
        "transfer_timeout_s": 20.0,
        "side_channel_timeout_s": 5.0,
        **over,
    }
    return MooncakeTransferEngineConnector(cfg)


#: the lease of the Mooncake test: a side-channel round trip on a loaded machine may take
#: most of a second, so a 1 s lease could lapse between two extensions
TE_TTL = 2.5


@pytest.mark.mooncake
def test_mooncake_te_extend_keeps_the_block_and_is_bounded_by_buffer_ttl() -> None:
    tx = _te("sender", buffer_ttl_s=2 * TE_TTL)
    rx = _te("receiver")
    leases: ProducerHandoffs | None = None
    try:
        session = TransferSession(tx, "0", "1", SessionPolicy(max_part_bytes=0))
        leases = ProducerHandoffs(session, TE_TTL)
        _send(session, leases, "k", 8)
        ep = {"source_host": "127.0.0.1", "source_port": tx.zmq_port}
        rx_session = TransferSession(rx, "0", "1", SessionPolicy())
        # an absurd request is capped at buffer_ttl_s; a non-finite one is refused
        assert rx_session.extend("k", ep, 1e9) == 1
        held = tx.held_until("0", "1", "k")
        assert held is not None and held <= time.monotonic() + 2 * TE_TTL
        assert not rx.extend("0", "1", "k", float("inf"), ep)
        end = time.monotonic() + 2 * TE_TTL
        while time.monotonic() < end:  # the consumer waits, extending
            assert rx_session.extend("k", ep, TE_TTL) == 1
            time.sleep(extend_every(TE_TTL))
        got = rx.get("0", "1", "k", ep)
        assert got is not None and _same(got[0], _payload(8))
        del got
        assert _until(lambda: len(leases) == 0) and leases.expired == 0
        assert _until(lambda: tx.pool.allocator.used == 0)
        # without extension the next one expires, and its pool block is freed
        _send(session, leases, "k2", 9)
        assert _until(lambda: leases.expired == 1)
        assert _until(lambda: tx.pool.allocator.used == 0)
        assert rx.get("0", "1", "k2", ep) is None
        assert rx.pool.allocator.used == 0
    finally:
        if leases is not None:
            leases.close()
        rx.close()
        tx.close()
