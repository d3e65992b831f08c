"""The producer's handoff of one payload: a state machine with one lease.

Every payload a producer worker publishes (one per target rank of a request) is a
:class:`Handoff`::

    PUBLISHED --claim--> CLAIMED --release--> RELEASED
        |  \\--release------------------------^
        |  \\--expire--> EXPIRED      (lease over, nobody reading: withdrawn)
        \\-----withdraw--> WITHDRAWN  (the request finished without a handoff)
    CLAIMED --expire--> EXPIRED      (the reader that held it is gone)
    PUBLISHED, CLAIMED --revoke--> WITHDRAWN  (vLLM preempted the request and freed its
                                    blocks: the payload is void, a reader is told)

A lease starts at ``send_ttl``; a consumer whose request waits for blocks extends it
(``extend``, in PUBLISHED or CLAIMED). CLAIMED means a consumer is copying the
payload's pages out of this process's cache, so the producer does not take them back
then; a claim that outlives the lease by ``grace`` seconds (a stopped or stuck
consumer) no longer counts: the producer voids the hold (the copy, when it ends, fails)
and takes the blocks back (EXPIRED).
Terminal states are RELEASED, EXPIRED, WITHDRAWN and FAILED (the send failed; nothing
was published). Every transition is a method; an illegal one raises
:class:`HandoffStateError`.

A *packed* payload is a copy of the blocks, so vLLM may free them as soon as it
finished the request; a *shared-pages* payload names the blocks themselves, so they
stay until the handoff is terminal. :class:`ProducerHandoffs` (one per worker) owns
every handoff, runs the lease timer and tells the worker which requests vLLM may
free (``finished_sending``).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from vllm_omni_kv.errors import OmniKVError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: longest wait between two checks of the lease deadlines (seconds)
CHECK_EVERY_S = 1.0
#: how often an idle producer checks its holds while it waits for consumers
POLL_S = 0.005
#: seconds past its lease a consumer may still hold a payload's blocks (``hold_grace``)
HOLD_GRACE_S = 30.0


class HandoffStateError(OmniKVError, RuntimeError):
    """A handoff was asked for a transition its state does not allow (a bug)."""


class HandoffState(enum.Enum):
    PUBLISHED = "published"
    CLAIMED = "claimed"
    RELEASED = "released"
    EXPIRED = "expired"
    WITHDRAWN = "withdrawn"
    FAILED = "failed"


S = HandoffState
TERMINAL = frozenset({S.RELEASED, S.EXPIRED, S.WITHDRAWN, S.FAILED})


def extend_every(send_ttl: float) -> float:
    """How often a consumer renews the leases of the payloads its waiting requests need."""
    return min(5.0, send_ttl / 3)


@dataclass
class Handoff:
    """One published payload: its key, its hold (shared pages) and its lease."""

    req_id: str
    key: str
    deadline: float
    hold: str = ""  # shared pages: the hold on the request's blocks ("" for packed)
    parts: int = 1
    state: HandoffState = S.PUBLISHED

    @property
    def shares_blocks(self) -> bool:
        return bool(self.hold)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def blocks_free(self) -> bool:
        """Whether vLLM may reuse the request's blocks as far as this payload goes."""
        return not self.shares_blocks or self.terminal

    def _move(self, to: HandoffState, allowed: Iterable[HandoffState]) -> None:
        if self.state not in allowed:
            raise HandoffStateError(
                f"handoff {self.key!r}: cannot go from {self.state.value} to {to.value}"
            )
        self.state = to

    def extend(self, until: float) -> None:
        """A waiting consumer asked to keep the payload until ``until`` (never shortens)."""
        self._move(self.state, (S.PUBLISHED, S.CLAIMED))
        self.deadline = max(self.deadline, until)

    def claim(self) -> None:
        """A consumer is copying the payload's pages: they cannot be taken back now."""
        self._move(S.CLAIMED, (S.PUBLISHED,))

    def release(self) -> None:
        """The consumer is done with the payload (copied, or gave it up unread)."""
        self._move(S.RELEASED, (S.PUBLISHED, S.CLAIMED))

    def expire(self) -> None:
        """The lease ran out with nobody reading: the payload was withdrawn."""
        self._move(S.EXPIRED, (S.PUBLISHED, S.CLAIMED))

    def withdraw(self) -> None:
        """The request finished without a handoff: the payload was withdrawn unread."""
        self._move(S.WITHDRAWN, (S.PUBLISHED,))

    def revoke(self) -> None:
        """vLLM freed the request's blocks (preemption): the payload is void."""
        self._move(S.WITHDRAWN, (S.PUBLISHED, S.CLAIMED))


class HandoffPort(Protocol):
    """What the handoffs need from the transport (``TransferSession`` implements it)."""

    def lease_until(self, key: str) -> float | None:
        """None once the payload is gone (consumed or withdrawn), else the monotonic time
        a consumer extended it to (0.0: never)."""

    def withdraw(self, key: str, parts: int) -> None:
        """Remove the unconsumed payload (every part)."""

    def hold_released(self, hold: str) -> bool:
        """Whether a consumer released ``hold``."""

    def take_back(self, hold: str) -> bool:
        """Remove ``hold`` unless a consumer is reading under it; True when it is gone."""

    def revoke(self, hold: str) -> None:
        """Mark ``hold`` void: a consumer copying under it fails instead of using pages
        that may be overwritten."""

    def expire_hold(self, hold: str) -> bool:
        """Void ``hold`` and take it back even while a consumer reads under it (it held
        the blocks past the lease and its grace); True when it is gone."""


@dataclass
class _Request:
    handoffs: list[Handoff] = field(default_factory=list)
    finished: bool = False  # vLLM finished the request (its blocks wait for us)
    reported: bool = False  # returned in finished_sending


class ProducerHandoffs:
    """Every handoff of one producer worker, their lease timer and their reporting."""

    def __init__(
        self, port: HandoffPort, ttl: float, *, grace: float = HOLD_GRACE_S, timer: bool = True
    ) -> None:
        self.port = port
        self.ttl = ttl
        self.grace = grace
        self.expired = 0  # leases that ran out while their payload was unconsumed
        self._reqs: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timer:
            every = min(CHECK_EVERY_S, max(0.05, ttl / 4))
            self._thread = threading.Thread(
                target=self._loop, args=(every,), name="omnikv-handoffs", daemon=True
            )
            self._thread.start()

    # -- publishing ----------------------------------------------------------------------
    def published(self, req_id: str, key: str, *, hold: str = "", parts: int = 1) -> Handoff:
        """Start the handoff of the payload just published under ``key``."""
        h = Handoff(req_id, key, time.monotonic() + self.ttl, hold, max(1, parts))
        with self._lock:
            self._reqs.setdefault(req_id, _Request()).handoffs.append(h)
        return h

    def failed(self, req_id: str) -> None:
        """The request's send failed: nothing of it stays published."""
        with self._lock:
            req = self._reqs.setdefault(req_id, _Request())
            for h in req.handoffs:
                if not h.terminal:
                    self._end(h, S.WITHDRAWN)
            req.handoffs.append(Handoff(req_id, "", 0.0, state=S.FAILED))

    def withdraw(self, req_ids: Iterable[str]) -> None:
        """These requests finished without a handoff: nobody will read their payloads."""
        with self._lock:
            for req_id in req_ids:
                req = self._reqs.get(req_id)
                for h in req.handoffs if req is not None else ():
                    if h.state is S.PUBLISHED:
                        self._end(h, S.WITHDRAWN)

    def revoke(self, req_ids: Iterable[str]) -> None:
        """vLLM preempted these requests and freed their blocks: void their payloads. A
        preempted request is saved again later; its handoffs then start anew."""
        with self._lock:
            for req_id in req_ids:
                req = self._reqs.get(req_id)
                for h in req.handoffs if req is not None else ():
                    if h.terminal:
                        continue
                    if h.shares_blocks:
                        self.port.revoke(h.hold)
                        self.port.take_back(h.hold)
                    self._withdraw(h)
                    h.revoke()
                    logger.info("request %s was preempted: withdrew its payload %s", req_id, h.key)

    def void_shared(self) -> int:
        """The cache is going away (vLLM's sleep): void every live payload that names its
        blocks, as a preemption does (packed payloads are copies: they stay). Holds a
        reader still keeps are the region's to void (``CacheRegion.sleep``). Returns how
        many were voided."""
        with self._lock:
            live = [
                h
                for q in self._reqs.values()
                for h in q.handoffs
                if h.shares_blocks and not h.terminal
            ]
            for h in live:
                self.port.take_back(h.hold)
                self._withdraw(h)
                h.revoke()
        return len(live)

    def state_of(self, req_id: str) -> list[HandoffState]:
        with self._lock:
            req = self._reqs.get(req_id)
            return [h.state for h in req.handoffs] if req is not None else []

    def __len__(self) -> int:
        """Handoffs not yet terminal."""
        with self._lock:
            return sum(not h.terminal for r in self._reqs.values() for h in r.handoffs)

    # -- transitions with their side effects (under the lock) ---------------------------
    def _end(self, h: Handoff, to: HandoffState, *, force: bool = False) -> None:
        """Take ``h`` to EXPIRED or WITHDRAWN: withdraw the payload, take back its hold
        (a reader copying keeps it CLAIMED until it releases, or until ``force``)."""
        if h.shares_blocks and not self.port.take_back(h.hold):
            if not force or not self.port.expire_hold(h.hold):
                if h.state is S.PUBLISHED:
                    h.claim()
                if force:
                    logger.warning(
                        "could not take the blocks of KV payload %s of %s back from a "
                        "consumer past its lease and grace: kept them (tried again later)",
                        h.key,
                        h.req_id,
                    )
                return
            logger.warning(
                "a consumer held the blocks of KV payload %s of %s for %gs past its lease "
                "(hold_grace) without finishing its copy (stopped or stuck): took them back; "
                "that consumer's load fails and recomputes",
                h.key,
                h.req_id,
                self.grace,
            )
        self._withdraw(h)
        if to is S.EXPIRED:
            h.expire()
            self.expired += 1
            logger.info(
                "withdrew the unconsumed KV payload %s of %s: its lease ran out (send_ttl=%gs)",
                h.key,
                h.req_id,
                self.ttl,
            )
        else:
            h.withdraw() if h.state is S.PUBLISHED else h.expire()

    def _withdraw(self, h: Handoff) -> None:
        try:
            self.port.withdraw(h.key, h.parts)
        except Exception as e:  # best effort: the backend's own TTL removes it
            logger.debug("withdrawing %s: %s", h.key, e)

    def _lease_over(self, h: Handoff, now: float) -> None:
        """``h``'s deadline passed: extend it, or end it."""
        try:
            until = self.port.lease_until(h.key)
        except Exception as e:  # cannot tell whether a consumer extended it: end it
            logger.debug("lease state of %s: %s", h.key, e)
            until = 0.0
        if until is not None and until > now:
            h.extend(until)  # a waiting consumer asked for more time
        elif until is None and not h.shares_blocks:
            self._withdraw(h)  # consumed; a backend that cannot tell may still hold it
            h.release()
        else:
            self._end(h, S.EXPIRED, force=now >= h.deadline + self.grace)

    def check(self, now: float | None = None) -> None:
        """Releases and lease deadlines of every live handoff."""
        now = time.monotonic() if now is None else now
        self._check_releases()
        with self._lock:
            for req in self._reqs.values():
                for h in req.handoffs:
                    if not h.terminal and h.deadline <= now:
                        self._lease_over(h, now)
            self._forget()

    def _forget(self) -> None:
        gone = [
            r for r, q in self._reqs.items() if q.reported and all(h.terminal for h in q.handoffs)
        ]
        for r in gone:
            del self._reqs[r]

    # -- reporting -----------------------------------------------------------------------
    def done(self, finished_req_ids: set[str], wait: float = 0.0) -> set[str]:
        """Requests whose blocks vLLM may free now: finished here, and every shared-pages
        payload of theirs terminal. ``wait``: on an engine step with nothing to compute,
        wait up to this long (checking every :data:`POLL_S`) for a hold to go."""
        until = time.monotonic() + wait
        with self._lock:
            for r in finished_req_ids:
                if r in self._reqs:
                    self._reqs[r].finished = True
        while True:
            self._check_releases()
            with self._lock:
                out = {
                    r
                    for r, q in self._reqs.items()
                    if q.finished and not q.reported and all(h.blocks_free for h in q.handoffs)
                }
                for r in out:
                    self._reqs[r].reported = True
                waiting = any(q.finished and not q.reported for q in self._reqs.values())
                self._forget()
            if out or not waiting or time.monotonic() + POLL_S > until:
                return out
            time.sleep(POLL_S)

    def _check_releases(self) -> None:
        with self._lock:
            for req in self._reqs.values():
                for h in req.handoffs:
                    if h.shares_blocks and not h.terminal and self.port.hold_released(h.hold):
                        h.release()

    # -- timer ---------------------------------------------------------------------------
    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.check()
            except Exception as e:  # keep the timer alive
                logger.warning("payload lease check failed: %s", e)

    def close(self) -> None:
        """Stop the timer and take back every hold (the engine stops; its cache goes)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            live = [h for q in self._reqs.values() for h in q.handoffs if not h.terminal]
            self._reqs.clear()
        for h in live:
            if h.shares_blocks:
                self.port.take_back(h.hold)
