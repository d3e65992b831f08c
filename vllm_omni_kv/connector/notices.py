"""Notices a consumer sends producers (a payload it will not read, a lease to extend):
best effort, on a thread of their own.

A notice to a paused or unreachable producer waits out the side channel's timeout. On the
load threads such notices queued up (the scheduler asks for an extension of every waiting
request every few seconds) and held loads from healthy producers past their deadlines.
Here one thread sends them; a notice of a request already waiting is not queued again;
a producer whose notice took over :data:`SLOW_S` gets none for :data:`QUIET_S` (so one
paused producer cannot hold the thread from the others); and at most :data:`MAX_WAITING`
wait. A notice dropped (counted) only leaves the payload to its producer's lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: notices queued and not yet started, at most
MAX_WAITING = 256
#: a notice that took longer than this (seconds) marks its producer silent...
SLOW_S = 1.0
#: ...and no notice goes to it for this long
QUIET_S = 10.0


class Notices:
    """One sender thread and its bounded queue of notices, each named by ``(kind, request)``."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnikv-notice")
        self._lock = threading.Lock()
        self._waiting: set[tuple[str, str]] = set()
        self._silent: dict[str, float] = {}  # producer -> until when it gets no notice
        self._closed = False
        self.dropped = 0

    def submit(self, kind: str, req_id: str, producer: str, send: Callable[[], None]) -> bool:
        """Queue ``send`` (a notice to ``producer``) unless the same notice already waits,
        the producer was silent lately, the queue is full or this is closed; True when
        queued."""
        with self._lock:
            name = (kind, req_id)
            if self._closed or name in self._waiting:
                return False
            if (
                len(self._waiting) >= MAX_WAITING
                or self._silent.get(producer, 0.0) > time.monotonic()
            ):
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th, ... drop
                    logger.warning(
                        "%d notices to producers dropped: their producers answer slowly or "
                        "not at all (their payloads expire by their leases)",
                        self.dropped,
                    )
                return False
            self._waiting.add(name)
        self._pool.submit(self._run, name, producer, send)
        return True

    def _run(self, name: tuple[str, str], producer: str, send: Callable[[], None]) -> None:
        with self._lock:
            self._waiting.discard(name)
        t0 = time.monotonic()
        try:
            send()
        except Exception as e:  # best effort: the producer's lease ends the payload
            logger.debug("%s notice for %s: %s", *name, e)
        now = time.monotonic()
        if now - t0 > SLOW_S:
            with self._lock:
                self._silent = {p: t for p, t in self._silent.items() if t > now}
                if len(self._silent) < MAX_WAITING:
                    self._silent[producer] = now + QUIET_S

    def close(self) -> None:
        """Drop what waits; a notice being sent ends within its own timeout, unwaited."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
