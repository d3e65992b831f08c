"""OmniKVPromMetrics records the workers' aggregated stats as Prometheus metrics."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector
from vllm_omni_kv.connector.stats import OmniKVConnectorStats


def _metric_types(reg: CollectorRegistry) -> dict[type, type]:
    """prometheus_client's classes, registering into ``reg`` instead of the global one."""

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)

        return Bound

    return {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}


def test_stats_become_prometheus_metrics() -> None:
    reg = CollectorRegistry()
    prom = OmniKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        _metric_types(reg),  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert prom is not None
    a, b = OmniKVConnectorStats(), OmniKVConnectorStats()
    a.record_recv(1 << 20, 0.004, 64, ok=True, transport="shm")
    b.record_recv(3 << 20, 0.02, 96, ok=True, transport="nixl:UCX")
    b.record_recv(1 << 10, 0.001, 1, ok=True, transport="shm")
    b.record_recv(0, 1.0, 0, ok=False, reason="timeout")
    b.record_recv(0, 0.1, 0, ok=False, reason="refused")
    b.record_recv(0, 0.1, 0, ok=False)
    b.record_send(5 << 20, 0.01, ok=True)
    b.set_held(3, 7 << 20)
    agg = a.aggregate(b)  # as vLLM aggregates two workers' stats
    prom.observe(agg.data, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}

    def value(name: str, **extra: str) -> float | None:
        return reg.get_sample_value(name, {**labels, **extra})

    assert value("vllm:omnikv_loads_total") == 3
    assert value("vllm:omnikv_received_bytes_total") == (4 << 20) + (1 << 10)
    assert value("vllm:omnikv_loaded_tokens_total") == 161
    assert value("vllm:omnikv_loads_by_transport_total", transport="shm") == 2
    assert value("vllm:omnikv_loads_by_transport_total", transport="nixl:UCX") == 1
    assert value("vllm:omnikv_sent_bytes_total") == 5 << 20
    assert value("vllm:omnikv_load_seconds_count") == 3
    assert value("vllm:omnikv_load_seconds_bucket", le="0.005") == 2
    assert value("vllm:omnikv_load_bytes_sum") == (4 << 20) + (1 << 10)
    for reason, n in (("timeout", 1), ("refused", 1), ("transport", 1), ("cancelled", 0)):
        assert value("vllm:omnikv_load_failures_total", reason=reason) == n
    assert value("vllm:omnikv_payloads_held") == 3
    assert value("vllm:omnikv_bytes_held") == 7 << 20


def test_loads_by_transport_survive_aggregation_and_stay_bounded() -> None:
    """Per-transport counts add up across workers and intervals (``take``); a worker
    cannot grow the label set past its bound with ever-new names."""
    from vllm_omni_kv.connector.stats import BY_TRANSPORT, MAX_TRANSPORTS

    a, b = OmniKVConnectorStats(), OmniKVConnectorStats()
    for i in range(MAX_TRANSPORTS + 5):
        a.record_recv(1, 0.001, 1, ok=True, transport=f"t{i}" + "x" * 100)
    b.record_recv(1, 0.001, 1, ok=True, transport="t0" + "x" * 100)
    b.record_recv(0, 0.1, 0, ok=False, transport="never-counted")
    snap = b.take()
    assert snap is not None and b.data[BY_TRANSPORT] == {}
    agg = a.aggregate(snap).data[BY_TRANSPORT]
    assert len(agg) == MAX_TRANSPORTS and all(len(k) == 64 for k in agg)
    assert agg[("t0" + "x" * 100)[:64]] == 2
    assert "never-counted" not in agg
