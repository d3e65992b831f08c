"""The loads of one worker on its load threads: each load's future and cancel event until
it lands, then its outcome until vLLM is told.

Load threads stay with the worker: they copy into its cache, and on spare cores they
slowed the forward passes (measured with ``benchmarks/pd_bench.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from vllm_omni_kv.connector.outcome import Outcome
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: a load's work, given its cancel event
Load = Callable[[threading.Event], Outcome]
#: the failed outcome of a load whose work raised, given why
Failed = Callable[[str], Outcome]


class InflightLoads:
    """Loads running (by request id) and outcomes waiting to be reported."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="omnikv-recv")
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # a load finished
        self._running: dict[str, tuple[Future[Outcome], threading.Event]] = {}
        self._outcomes: list[Outcome] = []

    def start(self, req_id: str, load: Load, failed: Failed) -> None:
        """Run ``load`` on a load thread; its outcome (``failed``'s if it raised) waits
        for :meth:`take`."""
        cancel = threading.Event()
        fut = self._pool.submit(load, cancel)
        with self._lock:
            self._running[req_id] = (fut, cancel)
        fut.add_done_callback(functools.partial(self._done, req_id, failed))

    def _done(self, req_id: str, failed: Failed, fut: Future[Outcome]) -> None:
        try:
            out = fut.result()
        except BaseException as e:  # cancelled at shutdown, or a bug
            out = failed(f"load aborted: {e!r}")
        with self._lock:
            self._running.pop(req_id, None)
            self._outcomes.append(out)
            self._landed.notify_all()

    def running(self) -> set[str]:
        with self._lock:
            return set(self._running)

    def cancel(self, req_ids: Iterable[str] | None = None) -> set[str]:
        """Cancel the running loads of ``req_ids`` (None: all); the ids cancelled."""
        with self._lock:
            hit = set(self._running) if req_ids is None else set(req_ids) & set(self._running)
            for req_id in hit:
                self._running[req_id][1].set()
        return hit

    def wait(self, pending: Callable[[set[str]], bool], timeout: float) -> None:
        """Wait up to ``timeout`` while ``pending(running ids)`` holds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pending(set(self._running)) and (left := deadline - time.monotonic()) > 0:
                self._landed.wait(left)

    def take(self) -> list[Outcome]:
        """The outcomes landed since the last call."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def relabel(self, change: Callable[[Outcome], Outcome]) -> set[str]:
        """Replace every waiting outcome by ``change`` of it; their request ids."""
        with self._lock:
            self._outcomes = [change(o) for o in self._outcomes]
            return {o.req_id for o in self._outcomes}

    def stop(self, end_transfers: Callable[[], None], wait_s: float, after_s: float) -> None:
        """Cancel every load and wait up to ``wait_s`` for them (a load ends by its own
        deadline); then run ``end_transfers`` (closing the backend, which ends what a load
        may still wait on: a paused producer's transfers) and wait up to ``after_s`` more.
        A load waiting on a paused producer never holds shutdown longer."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cancel()
        if self._join(wait_s):
            logger.warning(
                "shutdown: %d loads still run after %gs; closing the backend under them",
                len(self.running()),
                wait_s,
            )
        end_transfers()
        if self._join(after_s):
            logger.warning("shutdown: %d loads still wait on their producers", len(self.running()))

    def _join(self, timeout: float) -> bool:
        """Wait for the running loads; True when some still run after ``timeout``."""
        with self._lock:
            futs = [fut for fut, _cancel in self._running.values()]
        return bool(wait(futs, timeout).not_done)
