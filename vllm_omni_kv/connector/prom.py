"""Prometheus metrics of :class:`OmniKVConnector` (``build_prom_metrics``).

vLLM's frontend registers them once per server and feeds them the workers' aggregated
:class:`~vllm_omni_kv.connector.stats.OmniKVConnectorStats` every logging interval;
they appear on ``/metrics`` with vLLM's engine labels.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_omni_kv.connector.stats import BY_TRANSPORT, FAILURE_COUNTERS, FAILURE_REASONS

#: load latency buckets (seconds): shared memory loads take milliseconds, network ones more
LOAD_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
#: bytes per load: 64 KiB .. 16 GiB
LOAD_BYTES_BUCKETS = [float(2 ** (16 + 2 * i)) for i in range(10)]
_COUNTERS = {
    "bytes_sent": ("vllm:omnikv_sent_bytes", "KV bytes sent by this producer"),
    "num_sends": ("vllm:omnikv_sends", "Payloads sent"),
    "num_send_failures": ("vllm:omnikv_send_failures", "Payloads that could not be sent"),
    "bytes_received": ("vllm:omnikv_received_bytes", "KV bytes loaded by this consumer"),
    "num_recvs": ("vllm:omnikv_loads", "Successful KV loads"),
    "tokens_received": ("vllm:omnikv_loaded_tokens", "Prompt tokens loaded instead of computed"),
    "leases_expired": (
        "vllm:omnikv_leases_expired",
        "Unconsumed payloads a producer withdrew because their lease (send_ttl, or a "
        "consumer's extension) ran out",
    ),
    "notices_dropped": (
        "vllm:omnikv_notices_dropped",
        "Discards and lease extensions a consumer did not send (their producer answered "
        "slowly or not at all, or too many waited); those payloads end by their leases",
    ),
}


class OmniKVPromMetrics(KVConnectorPromMetrics):
    """Counters, load histograms and the payloads-held gauge, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per = self.per_engine_labelvalues
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per
            )
            for key, (name, doc) in _COUNTERS.items()
        }
        failures = self._counter_cls(
            name="vllm:omnikv_load_failures",
            documentation="Failed KV loads by reason (timeout, cancelled, refused, transport); "
            "vLLM recomputes or fails them per kv_load_failure_policy",
            labelnames=[*labelnames, "reason"],
        )
        self.failures = {
            idx: {r: failures.labels(*values, r) for r in FAILURE_REASONS}
            for idx, values in per.items()
        }
        self.by_transport = self._counter_cls(
            name="vllm:omnikv_loads_by_transport",
            documentation="Successful KV loads by what carried them (shm, cuda_ipc, "
            "mooncake_te:tcp, nixl:UCX[UCX_TLS=...]...)",
            labelnames=[*labelnames, "transport"],
        )
        self.load_seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:omnikv_load_seconds",
                documentation="Seconds from a load's scheduling to its KV written in the cache",
                buckets=LOAD_SECONDS_BUCKETS,
                labelnames=labelnames,
            ),
            per,
        )
        self.load_bytes = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:omnikv_load_bytes",
                documentation="Bytes moved per KV load",
                buckets=LOAD_BYTES_BUCKETS,
                labelnames=labelnames,
            ),
            per,
        )
        self.held = self._gauge(
            "vllm:omnikv_payloads_held",
            "Payloads a producer worker holds for consumers (max over TP ranks)",
            labelnames,
        )
        self.held_bytes = self._gauge(
            "vllm:omnikv_bytes_held",
            "Bytes of the payloads a producer worker holds (max over TP ranks)",
            labelnames,
        )

    def _gauge(self, name: str, doc: str, labelnames: list[str]) -> dict[int, Any]:
        gauge = self._gauge_cls(
            name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
        )
        return create_metric_per_engine(gauge, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for key, per_engine in self.counters.items():
            if d.get(key):
                per_engine[engine_idx].inc(d[key])
        failed = int(d.get("num_recv_failures", 0))
        named = 0
        for reason, key in FAILURE_COUNTERS.items():
            n = int(d.get(key, 0))
            named += n
            if n:
                self.failures[engine_idx][reason].inc(n)
        if failed > named:
            self.failures[engine_idx]["transport"].inc(failed - named)
        for name, n in d.get(BY_TRANSPORT, {}).items():
            self.by_transport.labels(*self.per_engine_labelvalues[engine_idx], name).inc(n)
        for s in d.get("load_seconds", ()):
            self.load_seconds[engine_idx].observe(s)
        for b in d.get("load_bytes", ()):
            self.load_bytes[engine_idx].observe(b)
        self.held[engine_idx].set(int(d.get("payloads_held", 0)))
        self.held_bytes[engine_idx].set(int(d.get("bytes_held", 0)))
