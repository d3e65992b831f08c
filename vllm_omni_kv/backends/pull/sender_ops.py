"""What a pull sender answers on its side channel: ``acquire``, ``release``, ``extend``
and ``ping``, served from its :class:`~.exposure.ExposureTable`."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from vllm_omni_kv.backends.pull.exposure import ExposureTable
from vllm_omni_kv.backends.pull.pull_stream import EngineAdapter

__all__ = ["SenderOps"]


def _positive(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and 0 < value < math.inf


class SenderOps:
    """The side-channel handler of one sender.

    ``lease_s`` is the lease an ``acquire`` gets when it names none; no lease or
    extension pins a buffer for longer than ``max_hold_s`` (the sender's ``buffer_ttl_s``).
    """

    def __init__(
        self,
        exposed: ExposureTable,
        engine: EngineAdapter,
        engine_id: str,
        lease_s: float,
        max_hold_s: float,
    ) -> None:
        self._exposed, self._engine, self._engine_id = exposed, engine, engine_id
        self._lease_s, self._max_hold_s = lease_s, max_hold_s

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "acquire":
            return self._acquire(msg)
        if op == "release":
            return self._release(msg)
        if op == "extend":
            return self._extend(msg)
        if op == "ping":
            return {"ok": True, "engine_id": self._engine_id, "session": self._engine.session}
        return {"ok": False, "reason": "error", "error": f"unknown side-channel op {op!r}"}

    def _acquire(self, msg: dict[str, Any]) -> dict[str, Any]:
        holder = msg.get("holder")
        lease_s = msg.get("lease_s", self._lease_s)
        if not _positive(lease_s):
            return {"ok": False, "reason": "error", "error": "lease_s must be positive"}
        reply = self._exposed.acquire(
            str(msg.get("key", "")),
            min(float(lease_s), self._max_hold_s),  # nobody pins a buffer for longer
            None if holder is None else str(holder),
        )
        if reply["ok"]:
            reply["session"] = self._engine.session
        return reply

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        # by the lease an acquire granted, or (a pull planned from the producer's put
        # metadata) by the block's token, which the side channel never discloses
        lease = msg.get("lease")
        return self._exposed.release(
            str(msg.get("token", "")),
            None if lease is None else str(lease),
            bool(msg.get("success", True)),
        )

    def _extend(self, msg: dict[str, Any]) -> dict[str, Any]:
        # like acquire: at most max_hold_s past the last call
        s = msg.get("lease_s")
        if not _positive(s):
            return {"ok": False, "reason": "error", "error": "lease_s must be positive"}
        return self._exposed.extend(str(msg.get("key", "")), min(s, self._max_hold_s))
