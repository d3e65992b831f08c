"""Which Mooncake store codes mean "master down", and the probe that waits for it.

A killed master makes store calls return ``RPC_FAIL`` (-900); a paused or wedged one
(SIGSTOP, a frozen container: its port still accepts connections) makes each call block
for the store client's RPC timeout (``MC_RPC_TIMEOUT_MS``, 30 s by default) and then
return ``RPC_TIMEOUT`` (-901). Either marks the master down: :class:`MasterProbe` sets a
flag the connector checks before each call, and a thread asks the master
``is_exist(PROBE_KEY)`` until it answers (0 or 1), each ask bounded by that RPC timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: Mooncake store error codes (mooncake-store ``ErrorCode``)
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
RPC_TIMEOUT = -901
#: codes that mean the master is down, and how the connector names them
MASTER_DOWN: dict[int, str] = {
    RPC_FAIL: f"RPC_FAIL {RPC_FAIL}: no connection",
    RPC_TIMEOUT: f"RPC_TIMEOUT {RPC_TIMEOUT}: no answer within the store client's RPC timeout",
}
#: the key a probe asks for while the master is down (never stored)
PROBE_KEY = "omnikv-master-probe"
#: pause between two probes of a master that is down
PROBE_INTERVAL_S = 0.5


class MasterProbe:
    """``down`` while the master does not answer; a thread probes it until it does."""

    def __init__(self, on_up: Callable[[], None]) -> None:
        self.down = threading.Event()
        #: why the master was marked down (a :data:`MASTER_DOWN` text)
        self.reason = ""
        self._on_up = on_up
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._in_call = False  # the probe thread is inside a store call
        self._stopped = False
        self._finish: Callable[[], None] | None = None  # handed over by :meth:`stop`

    def mark_down(self, store: Any, code: int) -> bool:
        """Set ``down`` and start probing ``store``; False when already down or stopped."""
        with self._lock:
            if self.down.is_set() or self._stopped:
                return False
            self.reason = MASTER_DOWN[code]
            self.down.set()
            threading.Thread(
                target=self._run, args=(store,), name="omnikv-mooncake-probe", daemon=True
            ).start()
        return True

    def _enter(self) -> bool:
        with self._lock:
            self._in_call = not self._stopped
            return self._in_call

    def _run(self, store: Any) -> None:
        while self._enter():
            up = int(store.is_exist(PROBE_KEY)) >= 0  # the master answered
            with self._lock:
                up = up and not self._stopped
                if up:
                    self.down.clear()
            if up:  # still inside the call window: ``stop`` hands its close to us
                self._on_up()
            with self._lock:
                self._in_call = False
                finish, stopped = self._finish, self._stopped
            if finish is not None:
                finish()
                return
            if stopped or up:
                return
            self._wake.wait(PROBE_INTERVAL_S)

    def stop(self, finish: Callable[[], None]) -> bool:
        """Stop probing. True: no probe call runs and the caller runs ``finish`` (closing
        the store); False: a probe call is in flight (up to the RPC timeout) and the probe
        thread runs ``finish`` once it returns, so the store is never closed under it."""
        with self._lock:
            self._stopped = True
            if self._in_call:
                self._finish = finish
                return False
        self._wake.set()
        return True
