"""Transfer statistics of :class:`OmniKVConnector` in vLLM's ``KVConnectorStats`` form.

Workers collect counters for one logging interval; vLLM aggregates the
objects of all workers (and intervals) with :meth:`aggregate` and logs
:meth:`reduce`. The payload (``data``) holds plain numbers only.
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
)


def _zero() -> dict[str, Any]:
    return {k: 0 for k in COUNTERS}


@dataclass
class OmniKVConnectorStats(KVConnectorStats):
    """Bytes, transfers, seconds and failures, per direction."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = _zero()
        for k, v in (self.data or {}).items():
            if k in base:
                base[k] = v
        self.data = base

    def record_send(self, nbytes: int, seconds: float, ok: bool) -> None:
        if ok:
            self.data["num_sends"] += 1
            self.data["bytes_sent"] += int(nbytes)
            self.data["send_seconds"] += float(seconds)
        else:
            self.data["num_send_failures"] += 1

    def record_recv(
        self, nbytes: int, seconds: float, tokens: int, ok: bool, timed_out: bool = False
    ) -> None:
        if ok:
            self.data["num_recvs"] += 1
            self.data["bytes_received"] += int(nbytes)
            self.data["recv_seconds"] += float(seconds)
            self.data["tokens_received"] += int(tokens)
        else:
            self.data["num_recv_failures"] += 1
            if timed_out:
                self.data["num_recv_timeouts"] += 1

    def reset(self) -> None:
        self.data = _zero()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, OmniKVConnectorStats):
            return self
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS if not k.endswith("seconds")}
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
        return not any(self.data.get(k) for k in COUNTERS)

    def take(self) -> OmniKVConnectorStats | None:
        """A copy of the counters (None when empty), and reset: one interval's worth."""
        if self.is_empty():
            return None
        snapshot = OmniKVConnectorStats(data=dict(self.data))
        self.reset()
        return snapshot
