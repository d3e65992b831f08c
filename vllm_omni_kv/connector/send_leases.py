"""Payload leases: how long a producer keeps what it sent, and how a waiting consumer extends it.

Producer: every payload (all its layer-wise parts) lives ``send_ttl`` after it was
sent. A timer thread, not the engine's steps, checks the deadlines, so an idle
producer frees its payloads too. At a deadline it asks the backend whether the
payload is still held and whether a consumer extended it (``held_until``); an
extended lease is re-armed for as long as the consumer asked, otherwise the
payload is withdrawn (``cleanup``) and, when it was still unconsumed, counted as
an expired lease.

Consumer: the scheduler half lists the remote payloads of requests that wait for
blocks; the worker extends each of their leases (every part) by ``send_ttl``
through the backend (``extend``): shared memory and Mooncake TE support it,
Mooncake Store and Yuanrong keep their own TTLs and extend nothing.
"""

from __future__ import annotations

import threading
import time

from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.parts import MAX_PARTS, part_key
from vllm_omni_kv.transfer.session import TransferSession

logger = init_logger(__name__)

#: longest wait between two checks of the deadlines (seconds)
CHECK_EVERY_S = 1.0


def extend_every(send_ttl: float) -> float:
    """How often a consumer renews the leases of the payloads its waiting requests need."""
    return min(5.0, send_ttl / 3)


class SendLeases:
    """The payloads one producer worker sent and still holds, expired by a timer thread."""

    def __init__(self, session: TransferSession, ttl: float) -> None:
        self.session = session
        self.ttl = ttl
        self.expired = 0  # leases that ran out while their payload was still unconsumed
        self._due: dict[str, tuple[float, int]] = {}  # key -> (deadline, number of parts)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._every = min(CHECK_EVERY_S, max(0.05, ttl / 4))
        self._thread = threading.Thread(target=self._loop, name="omnikv-send-leases", daemon=True)
        self._thread.start()

    def add(self, key: str, parts: int) -> None:
        """Start the lease of the payload just sent under ``key`` in ``parts`` parts."""
        with self._lock:
            self._due[key] = (time.monotonic() + self.ttl, max(1, parts))

    def __len__(self) -> int:
        with self._lock:
            return len(self._due)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.check()
            except Exception as e:  # keep the timer alive
                logger.warning("payload lease check failed: %s", e)

    def check(self, now: float | None = None) -> int:
        """Withdraw the payloads whose lease ran out; return how many were unconsumed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(k, n) for k, (t, n) in self._due.items() if t <= now]
        expired = 0
        s = self.session
        for key, parts in due:
            try:
                held = s.backend.held_until(s.from_stage, s.to_stage, key)
            except Exception as e:
                logger.debug("lease state of %s: %s", key, e)
                held = None
            if held is not None and held > now:  # a waiting consumer extended it
                with self._lock:
                    if key in self._due:
                        self._due[key] = (held, parts)
                continue
            with self._lock:
                self._due.pop(key, None)
            for i in range(parts):
                try:
                    s.backend.cleanup(part_key(key, i))
                except Exception as e:
                    logger.debug("cleanup of %s failed: %s", part_key(key, i), e)
            if held is not None:
                expired += 1
                logger.info(
                    "withdrew the unconsumed KV payload %s: its lease ran out (send_ttl=%gs)",
                    key,
                    self.ttl,
                )
        self.expired += expired
        return expired

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def extend_payload(
    session: TransferSession, key: str, endpoint: dict | None, seconds: float
) -> int:
    """Consumer: extend the lease of every part of the payload under ``key``; return how
    many parts were extended (0: not there, or the backend cannot extend)."""
    done = 0
    for i in range(MAX_PARTS):
        if not session.backend.extend(
            session.from_stage, session.to_stage, part_key(key, i), seconds, endpoint
        ):
            break
        done += 1
    return done
