"""Transfer statistics of :class:`OmniKVConnector` in vLLM's ``KVConnectorStats`` form.

Workers collect counters for one logging interval; vLLM aggregates the
objects of all workers (and intervals) with :meth:`aggregate` and logs
:meth:`reduce`. The payload (``data``) holds plain numbers, lists of numbers and the
loads per transport (a small dict of counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.connector.vllm_bases import KVConnectorStats

COUNTERS: tuple[str, ...] = (
    "num_sends",
    "bytes_sent",
    "send_seconds",
    "num_send_failures",
    "num_recvs",
    "bytes_received",
    "recv_seconds",
    "tokens_received",
    "num_recv_failures",
    "num_recv_timeouts",
    "num_recv_cancelled",
    "num_recv_refused",
    "leases_expired",
    "notices_dropped",
)
#: per-load samples of one interval (for histograms), at most MAX_SAMPLES each
SAMPLES: tuple[str, ...] = ("load_seconds", "load_bytes")
MAX_SAMPLES = 4096
#: current values: the largest over the workers and steps aggregated (each TP rank holds
#: one part of each request's payload)
GAUGES: tuple[str, ...] = ("payloads_held", "bytes_held")
#: successful loads per transport (the backend's ``transport()``): at most MAX_TRANSPORTS
#: names, each at most 64 characters
BY_TRANSPORT = "loads_by_transport"
MAX_TRANSPORTS = 16
#: why a load failed: ``num_recv_failures`` counts them all
FAILURE_REASONS = ("timeout", "cancelled", "refused", "transport")
#: the counter of each reason that has one of its own ("transport" is the rest)
FAILURE_COUNTERS = {
    "timeout": "num_recv_timeouts",
    "cancelled": "num_recv_cancelled",
    "refused": "num_recv_refused",
}


def _zero() -> dict[str, Any]:
    d: dict[str, Any] = {k: 0 for k in COUNTERS + GAUGES}
    d.update({k: [] for k in SAMPLES})
    d[BY_TRANSPORT] = {}
    return d


def _count_transport(into: dict[str, int], name: str, n: int) -> None:
    name = name[:64]
    if name in into or len(into) < MAX_TRANSPORTS:
        into[name] = into.get(name, 0) + int(n)


@dataclass
class OmniKVConnectorStats(KVConnectorStats):
    """Bytes, transfers, seconds and failures (by reason) per direction, per-load samples,
    the payloads a producer holds and those it withdrew when their lease expired."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = _zero()
        for k, v in (self.data or {}).items():
            if k == BY_TRANSPORT and isinstance(v, dict):
                for name, n in v.items():
                    _count_transport(base[k], str(name), int(n))
            elif k in base:
                base[k] = list(v) if k in SAMPLES else v
        self.data = base

    def record_send(self, nbytes: int, seconds: float, ok: bool) -> None:
        if ok:
            self.data["num_sends"] += 1
            self.data["bytes_sent"] += int(nbytes)
            self.data["send_seconds"] += float(seconds)
        else:
            self.data["num_send_failures"] += 1

    def record_recv(
        self,
        nbytes: int,
        seconds: float,
        tokens: int,
        ok: bool,
        reason: str = "transport",
        transport: str = "",
    ) -> None:
        """One finished load; ``reason`` (one of :data:`FAILURE_REASONS`) when it failed,
        ``transport``: what carried it."""
        if ok:
            self.data["num_recvs"] += 1
            if transport:
                _count_transport(self.data[BY_TRANSPORT], transport, 1)
            self.data["bytes_received"] += int(nbytes)
            self.data["recv_seconds"] += float(seconds)
            self.data["tokens_received"] += int(tokens)
            if len(self.data["load_seconds"]) < MAX_SAMPLES:
                self.data["load_seconds"].append(round(float(seconds), 6))
                self.data["load_bytes"].append(int(nbytes))
            return
        self.data["num_recv_failures"] += 1
        key = FAILURE_COUNTERS.get(reason)
        if key is not None:
            self.data[key] += 1

    def record_leases_expired(self, n: int) -> None:
        """``n`` unconsumed payloads were withdrawn because their lease ran out."""
        self.data["leases_expired"] += int(n)

    def record_notices_dropped(self, n: int) -> None:
        """``n`` discards or lease extensions were not sent to their producers."""
        self.data["notices_dropped"] += int(n)

    def set_held(self, payloads: int, nbytes: int = 0) -> None:
        # a change is reported even in an otherwise empty interval (a drop to 0 included)
        self.data["held_changed"] = (int(payloads), int(nbytes)) != (
            self.data.get("payloads_held", 0),
            self.data.get("bytes_held", 0),
        )
        self.data["payloads_held"] = int(payloads)
        self.data["bytes_held"] = int(nbytes)

    def reset(self) -> None:
        held = {k: self.data.get(k, 0) for k in GAUGES}
        self.data = _zero()
        self.data.update(held)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, OmniKVConnectorStats):
            return self
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in GAUGES:
            self.data[k] = max(self.data.get(k, 0), other.data.get(k, 0))
        for k in SAMPLES:
            room = MAX_SAMPLES - len(self.data[k])
            self.data[k] = list(self.data[k]) + list(other.data.get(k, []))[: max(0, room)]
        for name, n in other.data.get(BY_TRANSPORT, {}).items():
            _count_transport(self.data[BY_TRANSPORT], name, n)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            k: d[k] for k in COUNTERS + GAUGES if not k.endswith("seconds")
        }
        out["send_seconds"] = round(float(d["send_seconds"]), 6)
        out["recv_seconds"] = round(float(d["recv_seconds"]), 6)
        out["send_GBps"] = (
            round(d["bytes_sent"] / d["send_seconds"] / 1e9, 3) if d["send_seconds"] > 0 else 0.0
        )
        out["recv_GBps"] = (
            round(d["bytes_received"] / d["recv_seconds"] / 1e9, 3)
            if d["recv_seconds"] > 0
            else 0.0
        )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*COUNTERS, *GAUGES, "held_changed"))

    def take(self) -> OmniKVConnectorStats | None:
        """A copy of one interval's counters and samples (None when empty), then reset
        (the held-payload gauge carries over)."""
        if self.is_empty():
            return None
        snapshot = OmniKVConnectorStats(data=dict(self.data))
        self.reset()
        return snapshot
