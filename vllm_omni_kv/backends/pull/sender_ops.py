"""What a pull sender answers on its side channel: ``acquire``, ``release``, ``extend``,
``holder`` and ``ping``, served from its :class:`~.exposure.ExposureTable`.

Holders: a receiver names itself in ``acquire`` so that a new acquire replaces the lease
of an attempt it gave up on. The holder id is a capability the sender issues (op
``holder``, and every ``acquire`` reply carries one): 16 random bytes and their keyed
BLAKE2b tag under a secret of this sender process, in hex. An acquire that
names anything else (a string of the client's choosing, another sender's or a
restarted sender's id) is served as a new holder and gets a fresh id, so only a
receiver that was given an id can replace a lease held under it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from typing import Any, TypeGuard

from vllm_omni_kv.backends.pull.exposure import ExposureTable
from vllm_omni_kv.backends.pull.puller import EngineAdapter

__all__ = ["SenderOps"]


#: bytes of randomness (and of tag) in a holder id
HOLDER_BYTES = 16


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
        self._holder_key = secrets.token_bytes(32)

    def issue_holder(self) -> str:
        """A fresh holder id of this sender (unguessable without its secret)."""
        rand = secrets.token_bytes(HOLDER_BYTES)
        return (rand + self._holder_tag(rand)).hex()

    def _holder_tag(self, rand: bytes) -> bytes:
        return hashlib.blake2b(rand, key=self._holder_key, digest_size=HOLDER_BYTES).digest()

    def _issued(self, holder: Any) -> bool:
        """Whether ``holder`` is an id this sender issued."""
        if not isinstance(holder, str) or len(holder) != 4 * HOLDER_BYTES:
            return False
        try:
            raw = bytes.fromhex(holder)
        except ValueError:
            return False
        return hmac.compare_digest(self._holder_tag(raw[:HOLDER_BYTES]), raw[HOLDER_BYTES:])

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "acquire":
            return self._acquire(msg)
        if op == "release":
            return self._release(msg)
        if op == "extend":
            return self._extend(msg)
        if op == "holder":
            return {"ok": True, "holder": self.issue_holder()}
        if op == "ping":
            return {"ok": True, "engine_id": self._engine_id, "session": self._engine.session}
        return {"ok": False, "reason": "error", "error": f"unknown side-channel op {op!r}"}

    def _acquire(self, msg: dict[str, Any]) -> dict[str, Any]:
        holder = msg.get("holder")
        if not self._issued(holder):
            holder = self.issue_holder()  # a new receiver, or an id not of this sender
        lease_s = msg.get("lease_s", self._lease_s)
        if not _positive(lease_s):
            return {"ok": False, "reason": "error", "error": "lease_s must be positive"}
        reply = self._exposed.acquire(
            str(msg.get("key", "")),
            min(float(lease_s), self._max_hold_s),  # nobody pins a buffer for longer
            holder,
        )
        if reply["ok"]:
            reply["session"] = self._engine.session
        reply["holder"] = holder  # the receiver names itself by it from now on
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
