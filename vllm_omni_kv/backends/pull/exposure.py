"""Sender-side bookkeeping of pool blocks exposed for pulling (leases, pull counts, TTL).

Every ``put`` creates an :class:`Exposure` identified by a random token. A
receiver ``acquire``s a lease (so the TTL sweep cannot free the block under an
in-flight pull), pulls, then ``release``s it by the lease id; a consumer still waiting
to pull may ``extend`` the block's lifetime (bounded by the TTL per call); the reply tells it
whether the block stayed live for the whole pull. The token is never disclosed by
``acquire``: only a pull planned from the producer's put metadata releases by it. A block is freed after ``max_pulls`` successful
pulls (``0``: only by cleanup / TTL), when its TTL passes with no lease held,
or when it is retired (cleanup / replaced by a newer put) and its last lease
ends. A small block in a host pool (at most :data:`INLINE_MAX` bytes: a ``register_cache``
payload's frame of block ids and geometry, a small tensor) travels in the ``acquire`` reply
itself (``frame``), which saves the receiver an engine transfer; the lease and the release
are the same. A larger frame in a host pool whose prelude, header and digest trailer
together fit in :data:`INLINE_MAX` bytes sends those (``head``, ``tail`` at ``tail_at``)
instead: the receiver then pulls only the data it loads. All methods are thread-safe.
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.logger import LogBudget, init_logger
from vllm_omni_kv.wire.prelude import PRELUDE_SIZE, read_prelude

logger = init_logger(__name__)
#: expired leases (a side-channel peer can take and drop 64 per block)
_expired = LogBudget(logger)

#: extra time a lease outlives the receiver's own transfer timeout
LEASE_SLACK_S = 5.0
#: a block of at most this many bytes in a host pool is sent in the ``acquire`` reply
INLINE_MAX = 16 << 10
#: leases one block holds at once, ``max_pulls: 0`` too (receivers past it wait for one to
#: end): a peer that acquires without end cannot grow the table
MAX_LEASES = 64


@dataclass
class Exposure:
    key: str
    token: str
    buf: ManagedBuffer
    size: int
    fast: bool
    dtype: str | None
    shape: list[int] | None
    expires: float
    remaining: int  # successful pulls left (ignored when unlimited)
    unlimited: bool
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> deadline
    holders: dict[str, str] = field(default_factory=dict)  # receiver id -> its lease id
    retired: bool = False
    extended: float = 0.0  # the monotonic deadline a consumer extended its lease to
    inline: bool = False  # a small block in host memory: its bytes go with the acquire reply
    edges: tuple[int, int, int] | None = None  # a larger host frame: head end, trailer span


def frame_edges(address: int, size: int) -> tuple[int, int, int] | None:
    """``(data_start, trailer_start, total)`` of the frame in the host memory at
    ``address`` when its head and trailer fit in :data:`INLINE_MAX` bytes together, else
    None (also for bytes that are not a frame)."""
    if size < PRELUDE_SIZE:
        return None
    try:
        p = read_prelude(ctypes.string_at(address, PRELUDE_SIZE), size)
    except KVPayloadError:
        return None
    if p.data_start + p.trailer_len > INLINE_MAX:
        return None
    return p.data_start, p.trailer_start, p.total


def _forget_holder(e: Exposure, lease: str | None) -> None:
    for holder, held in list(e.holders.items()):
        if held == lease:
            del e.holders[holder]


class ExposureTable:
    """The blocks one sender currently exposes, by key and by token."""

    def __init__(self, ttl_s: float, max_pulls: int, lease_slack_s: float = LEASE_SLACK_S) -> None:
        self.ttl_s = ttl_s
        self.max_pulls = max_pulls
        self.lease_slack_s = lease_slack_s
        self._lock = threading.Lock()
        self._by_token: dict[str, Exposure] = {}
        self._by_key: dict[str, str] = {}
        self._by_lease: dict[str, str] = {}  # lease id -> token
        self.expired = 0

    def add(
        self,
        key: str,
        buf: ManagedBuffer,
        size: int,
        fast: bool,
        dtype: str | None = None,
        shape: list[int] | None = None,
        host: bool = False,
    ) -> Exposure:
        """Expose ``buf``'s first ``size`` bytes under ``key`` (``fast``: a raw buffer, else
        a frame; ``host``: ``buf`` is host memory)."""
        e = Exposure(
            key=key,
            token=uuid.uuid4().hex,
            buf=buf,
            size=size,
            fast=fast,
            dtype=dtype,
            shape=shape,
            expires=time.monotonic() + self.ttl_s,
            remaining=self.max_pulls,
            unlimited=self.max_pulls == 0,
            inline=host and size <= INLINE_MAX,
        )
        if host and not fast and not e.inline:
            e.edges = frame_edges(buf.address, size)
        with self._lock:
            old = self._by_key.get(key)
            if old is not None:  # a re-put replaces the key; the old block ends with its leases
                self._retire_locked(self._by_token[old])
            self._by_token[e.token] = e
            self._by_key[key] = e.token
        return e

    # -- internal (lock held) --------------------------------------------------------
    def _retire_locked(self, e: Exposure) -> None:
        e.retired = True
        if self._by_key.get(e.key) == e.token:
            del self._by_key[e.key]
        if not e.leases:
            self._free_locked(e)

    def _drop_lease_locked(self, e: Exposure, lease: str) -> None:
        e.leases.pop(lease, None)
        self._by_lease.pop(lease, None)
        _forget_holder(e, lease)

    def _free_locked(self, e: Exposure) -> None:
        for lease in list(e.leases):
            self._by_lease.pop(lease, None)
        if self._by_token.pop(e.token, None) is not None:
            if self._by_key.get(e.key) == e.token:
                del self._by_key[e.key]
            e.buf.release()

    # -- side-channel operations -----------------------------------------------------
    def acquire(self, key: str, lease_s: float, holder: str | None = None) -> dict[str, Any]:
        """Lease ``key`` for one pull. A receiver that names itself (``holder``) holds at
        most one lease per key: a new acquire replaces the lease of an attempt it gave up
        on (e.g. its acquire timed out after we had granted it), so that orphan does not
        count against ``max_pulls`` until it expires."""
        with self._lock:
            e = self._by_token.get(self._by_key.get(key, ""))
            if e is None:
                return {"ok": False, "reason": "not_found"}
            if holder is not None:
                stale = e.holders.get(holder)
                if stale is not None:
                    self._drop_lease_locked(e, stale)
            room = MAX_LEASES if e.unlimited else min(MAX_LEASES, e.remaining)
            if len(e.leases) >= room:
                return {"ok": False, "reason": "exhausted"}
            lease = uuid.uuid4().hex
            e.leases[lease] = time.monotonic() + lease_s + self.lease_slack_s
            self._by_lease[lease] = e.token
            if holder is not None:
                e.holders[holder] = lease
            reply = {
                "ok": True,
                "lease": lease,
                "src_addr": e.buf.address,
                "data_size": e.size,
                "is_fast_path": e.fast,
                "dtype": e.dtype,
                "shape": e.shape,
            }
            if e.inline:  # the block stays ours while the lock is held
                reply["frame"] = ctypes.string_at(e.buf.address, e.size)
            elif e.edges is not None:
                head, tail_at, end = e.edges
                reply["head"] = ctypes.string_at(e.buf.address, head)
                reply["tail_at"] = tail_at
                reply["tail"] = ctypes.string_at(e.buf.address + tail_at, end - tail_at)
            return reply

    def release(self, token: str, lease: str | None, success: bool) -> dict[str, Any]:
        """End a pull, named by its lease (an acquire's) or else by the block's token (a
        pull planned from the producer's put metadata); ``ok`` is False when the block did
        not stay live for all of it."""
        with self._lock:
            if lease is not None:
                e = self._by_token.get(self._by_lease.get(lease, ""))
                if e is None or lease not in e.leases:
                    return {"ok": False, "reason": "expired"}
                self._drop_lease_locked(e, lease)
            else:
                e = self._by_token.get(token)
                if e is None:
                    return {"ok": False, "reason": "expired"}
            if success and not e.unlimited:
                e.remaining -= 1
            done = not e.unlimited and e.remaining <= 0
            if (done or e.retired) and not e.leases:
                self._free_locked(e)
            return {"ok": True}

    def sweep(self) -> None:
        """Drop leases past their deadline and free blocks past their TTL."""
        now = time.monotonic()
        with self._lock:
            for e in list(self._by_token.values()):
                for lease, deadline in list(e.leases.items()):
                    if now > deadline:
                        _expired.warning(
                            "a pull lease on %r expired: its receiver never finished", e.key
                        )
                        self._drop_lease_locked(e, lease)
                if e.leases:
                    continue
                if e.retired:
                    self._free_locked(e)
                elif now > e.expires:
                    self.expired += 1
                    logger.info("buffer %r was not pulled within %.0fs; freed", e.key, self.ttl_s)
                    self._free_locked(e)

    def extend(self, key: str, seconds: float) -> dict[str, Any]:
        """A waiting consumer keeps ``key`` for ``seconds`` more (the caller bounds them);
        the block's TTL is pushed out as far."""
        with self._lock:
            e = self._by_token.get(self._by_key.get(key, ""))
            if e is None or e.retired:
                return {"ok": False, "reason": "not_found"}
            until = time.monotonic() + seconds
            e.extended = max(e.extended, until)
            e.expires = max(e.expires, until)
            return {"ok": True, "seconds": seconds}

    def held_until(self, key: str) -> float | None:
        """None when ``key`` is no longer exposed, else its extension deadline (0.0: none)."""
        with self._lock:
            e = self._by_token.get(self._by_key.get(key, ""))
            return None if e is None or e.retired else e.extended

    def exposed(self, key: str) -> bool:
        """Whether a block of ``key`` (retired ones too) is still held."""
        with self._lock:
            return any(e.key == key for e in self._by_token.values())

    def withdraw(self, key: str) -> bool:
        """Free every block of ``key`` (retired ones too) unless a receiver holds a lease
        on one that has not run out (an expired lease of a dead receiver does not count);
        True when none is left."""
        now = time.monotonic()
        with self._lock:
            hits = [e for e in self._by_token.values() if e.key == key]
            if any(deadline >= now for e in hits for deadline in e.leases.values()):
                return False
            for e in hits:
                self._free_locked(e)
            return True

    def revoke(self, key: str) -> int:
        """Free every block of ``key`` now, even under a live lease (the memory its pulls
        read is going away: vLLM's sleep); that lease's release then fails. Returns how
        many were freed."""
        with self._lock:
            hits = [e for e in self._by_token.values() if e.key == key]
            for e in hits:
                self._free_locked(e)
            return len(hits)

    # -- owner operations ------------------------------------------------------------
    def retain(self, key: str, pulls: int) -> bool:
        with self._lock:
            e = self._by_token.get(self._by_key.get(key, ""))
            if e is None:
                return False
            e.remaining += pulls
            e.expires = time.monotonic() + self.ttl_s
            return True

    def retire_where(self, match: Callable[[str], bool]) -> int:
        with self._lock:
            hits = [e for e in self._by_token.values() if not e.retired and match(e.key)]
            for e in hits:
                self._retire_locked(e)
            return len(hits)

    def free_all(self) -> None:
        with self._lock:
            for e in list(self._by_token.values()):
                self._free_locked(e)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "exposed_keys": len(self._by_key),
                "held_bytes": sum(e.size for e in self._by_token.values()),
                "exposed_blocks": len(self._by_token),
                "active_leases": sum(len(e.leases) for e in self._by_token.values()),
                "expired": self.expired,
            }
