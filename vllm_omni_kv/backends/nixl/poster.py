"""Writes a producer accepted, made and posted on a thread of their own, in order.

Making and posting a NIXL write can copy all of its bytes before it returns (UCX's
shared-memory transports on one host: a 256 MiB write took 30-140 ms), so the
side-channel thread only checks a large write and queues it here: acquires, releases and other
sinks' requests are answered meanwhile. A write is *waiting* until the thread takes it,
then *posting* until ``post`` returned (by then the writer tracks it, or its sink was
told it failed). A waiting write can be withdrawn (an abort before it was posted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)


class Poster:
    """Runs ``post(nonce, job)`` for each submitted write, one at a time."""

    def __init__(self, post: Callable[[bytes, Any], None]) -> None:
        self._post = post
        self._lock = threading.Condition()
        self._waiting: OrderedDict[bytes, tuple[str, Any]] = OrderedDict()
        self._posting: dict[bytes, str] = {}  # nonce -> sink, while ``post`` runs
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, nonce: bytes, sink: str, job: Any) -> None:
        with self._lock:
            self._waiting[nonce] = (sink, job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omnikv-nixl-poster")
                self._thread.daemon = True
                self._thread.start()
            self._lock.notify()

    def state(self, nonce: bytes) -> str | None:
        """``waiting``, ``posting``, or None (not here: posted, withdrawn or unknown)."""
        with self._lock:
            if nonce in self._waiting:
                return "waiting"
            return "posting" if nonce in self._posting else None

    def withdraw(self, nonce: bytes, sink: str) -> bool:
        """Take ``sink``'s waiting write out (it is never posted); False when no write of
        that sink is waiting under ``nonce``."""
        with self._lock:
            if self._waiting.get(nonce, ("", None))[0] != sink:
                return False
            del self._waiting[nonce]
            return True

    def count(self, sink: str | None = None) -> int:
        """Writes waiting or posting (of ``sink``, or of all)."""
        with self._lock:
            sinks = [s for s, _job in self._waiting.values()] + list(self._posting.values())
        return len(sinks) if sink is None else sinks.count(sink)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                nonce, (sink, job) = self._waiting.popitem(last=False)
                self._posting[nonce] = sink
            try:
                self._post(nonce, job)
            except Exception:
                logger.exception("posting a NIXL write to %s failed", sink)
            finally:
                with self._lock:
                    del self._posting[nonce]

    def close(self) -> None:
        """Drop the waiting writes and stop once the one posting (if any) is done."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
