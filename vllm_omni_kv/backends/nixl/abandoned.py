"""NIXL transfers given up on that may still move bytes, polled to their end.

Releasing a NIXL transfer that is still ``PROC`` does not stop it over every UCX
transport: over TCP its bytes keep landing after ``release`` returned. A transfer past
its deadline is handed to :class:`Abandoned` instead (its peer's metadata stays loaded
meanwhile: NIXL fails a transfer whose remote agent is removed, while UCX may still land
its bytes): one thread polls it (with the
device of the thread that handed it over made current) until it leaves ``PROC``, then
releases it and completes its future, which keeps the transfer's destination allocated
until then. ``close`` completes every future: the agent, and its transports, go with it.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_kv.backends.backoff import Backoff
from vllm_omni_kv.kvcache.device_order import bind_device, cuda_device_in_use
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: a transfer still running this long after it was given up on is logged (once)
WARN_AFTER_S = 60.0


@dataclass
class _Transfer:
    handle: Any
    peer: str
    what: str
    device: torch.device | None
    ended: cf.Future[None] = field(default_factory=cf.Future)
    since: float = field(default_factory=time.monotonic)
    warned: bool = False


class Abandoned:
    """Transfers of one agent given up on; ``state(handle)`` is NIXL's state of one."""

    def __init__(self, state: Callable[[Any], str]) -> None:
        self._state = state
        self._lock = threading.Condition()
        self._running: list[_Transfer] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, handle: Any, peer: str, what: str) -> cf.Future[None]:
        """Take over ``handle``, a transfer with remote agent ``peer`` (``what``: for the
        log); the future completes once no byte of it can land any more."""
        t = _Transfer(handle, peer, what, cuda_device_in_use())
        with self._lock:
            if self._closed:
                t.ended.set_result(None)
                return t.ended
            self._running.append(t)
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="omnikv-nixl-abandoned")
                self._thread.daemon = True
                self._thread.start()
            self._lock.notify()
        return t.ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)

    def holds(self, peer: str) -> bool:
        """Whether a transfer with ``peer`` is still polled here: its metadata must stay
        loaded (NIXL fails a transfer whose remote agent is removed, while UCX may still
        land its bytes)."""
        with self._lock:
            return any(t.peer == peer for t in self._running)

    def _poll(self) -> None:
        backoff = Backoff()
        while True:
            with self._lock:
                while not self._running and not self._closed:
                    self._lock.wait()
                    backoff.reset()
                if self._closed:
                    return
                running = list(self._running)
            ended = [t for t in running if self._ended(t)]
            with self._lock:
                self._running = [t for t in self._running if t not in ended]
            for t in ended:
                t.ended.set_result(None)
            backoff.sleep()

    def _ended(self, t: _Transfer) -> bool:
        bind_device(t.device)
        try:
            state = str(self._state(t.handle))
        except Exception as e:
            logger.debug("NIXL state of %s: %s", t.what, e)
            state = "ERR"
        if state == "PROC":
            if not t.warned and time.monotonic() - t.since > WARN_AFTER_S:
                t.warned = True
                logger.warning(
                    "%s still runs %.0f s after it was given up on; its destination stays "
                    "allocated until it ends",
                    t.what,
                    WARN_AFTER_S,
                )
            return False
        try:
            t.handle.release()
        except Exception as e:
            logger.debug("releasing %s: %s", t.what, e)
        return True

    def close(self) -> None:
        """Complete every future (call as the agent goes: its transfers stop with it) and
        let go of the agent."""
        with self._lock:
            self._closed = True
            running, self._running = self._running, []
            self._lock.notify_all()
        for t in running:
            t.ended.set_result(None)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._state = _gone  # no reference to the agent outlives its engine's close


def _gone(_handle: Any) -> str:
    return "ERR"
