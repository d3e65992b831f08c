"""Small pieces of the connector, without an engine: stats, worker metadata, ids, block runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_omni_kv.connector.metadata import (  # noqa: E402
    OmniKVWorkerMetadata,
    prompt_digest,
    transfer_id,
)
from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector  # noqa: E402
from vllm_omni_kv.connector.stats import OmniKVConnectorStats  # noqa: E402
from vllm_omni_kv.kvcache.paged_blocks import block_runs as _runs  # noqa: E402


def test_stats_aggregate_and_reduce() -> None:
    a = OmniKVConnectorStats()
    assert a.is_empty() and a.take() is None
    a.record_send(1_000_000_000, 0.5, ok=True)
    a.record_recv(2_000_000_000, 1.0, tokens=300, ok=True)
    b = OmniKVConnectorStats()
    b.record_recv(0, 0.0, tokens=0, ok=False, reason="timeout")
    b.record_send(0, 0.0, ok=False)
    merged = a.aggregate(b)
    r = merged.reduce()
    assert r["num_sends"] == 1 and r["num_send_failures"] == 1
    assert r["num_recvs"] == 1 and r["num_recv_failures"] == 1 and r["num_recv_timeouts"] == 1
    assert r["bytes_received"] == 2_000_000_000 and r["recv_GBps"] == 2.0
    assert r["tokens_received"] == 300 and r["send_GBps"] == 2.0


def test_stats_round_trip_through_build_kv_connector_stats() -> None:
    s = OmniKVConnectorStats()
    s.record_recv(10, 0.1, tokens=5, ok=True)
    snap = s.take()
    assert snap is not None and s.is_empty()
    rebuilt = OmniKVConnector.build_kv_connector_stats(snap.to_dict())
    assert isinstance(rebuilt, OmniKVConnectorStats)
    assert rebuilt.reduce()["bytes_received"] == 10
    assert OmniKVConnector.build_kv_connector_stats({"junk": 1}).is_empty()  # type: ignore[union-attr]


def test_worker_metadata_aggregates_tp_ranks() -> None:
    a = OmniKVWorkerMetadata({"r1": {"ok": True, "tokens": 64, "bytes": 100, "seconds": 0.1}})
    b = OmniKVWorkerMetadata(
        {
            "r1": {"ok": False, "tokens": 0, "bytes": 50, "seconds": 0.3, "error": "timeout"},
            "r2": {"ok": True, "tokens": 32, "bytes": 10, "seconds": 0.01},
        }
    )
    m = a.aggregate(b)
    assert isinstance(m, OmniKVWorkerMetadata)
    assert m.loads["r1"] == {
        "ok": False,
        "tokens": 0,
        "bytes": 150,
        "seconds": 0.3,
        "error": "timeout",
    }
    assert m.loads["r2"]["ok"] is True
    assert a.loads["r1"]["ok"] is True  # inputs untouched


def test_transfer_id_is_safe_and_distinct() -> None:
    tid = transfer_id("eng/1 x", "cmpl-ab_c:0")
    assert all(c.isalnum() or c in ".-" for c in tid)
    assert transfer_id("e", "a") != transfer_id("e", "b")
    assert prompt_digest([1, 2, 3]) == prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest(None) == prompt_digest([])


def test_runs_of_consecutive_blocks() -> None:
    assert _runs([]) == []
    assert _runs([7]) == [(0, 7, 1)]
    assert _runs([5, 6, 7, 9, 10, 3]) == [(0, 5, 3), (3, 9, 2), (5, 3, 1)]
