"""Logging through vLLM's ``init_logger`` inside vLLM processes.

vLLM configures (and re-configures, per process) only its own ``vllm`` logger.
Inside a vLLM process our ``vllm_omni_kv`` logger is therefore made a child of
``vllm``: our lines go through vLLM's handlers with its prefix (level, time,
file), follow ``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH`` and
``VLLM_CONFIGURE_LOGGING``, whenever vLLM sets them up. vLLM-free stages (a
diffusion worker, a benchmark) get plain stdlib loggers, so importing the
transfer core never drags in vLLM.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

ROOT = "vllm_omni_kv"


def _attach_to_vllm() -> None:
    ours, theirs = logging.getLogger(ROOT), logging.getLogger("vllm")
    if ours.parent is not theirs:
        ours.parent = theirs  # records propagate to vLLM's handlers; levels inherit from it


def init_logger(name: str) -> logging.Logger:
    """Return vLLM's logger (with its helpers) when vLLM is loaded, else a stdlib one."""
    if "vllm" in sys.modules:
        try:
            from vllm.logger import init_logger as _vllm_init_logger

            logger = _vllm_init_logger(name)
            if name == ROOT or name.startswith(ROOT + "."):
                _attach_to_vllm()
            return logger
        except Exception:  # pragma: no cover - partially initialised vLLM
            pass
    return logging.getLogger(name)


class LogBudget:
    """Lines of one kind that a peer or a client can cause at will (one per request): at
    most ``burst`` at once, then ``rate`` per second; a line that follows lines held back
    says how many."""

    def __init__(self, logger: logging.Logger, rate: float = 1.0, burst: int = 20) -> None:
        self.logger, self.rate, self.burst = logger, rate, burst
        self._lock = threading.Lock()
        self._tokens, self._at, self._held = float(burst), time.monotonic(), 0

    def log(self, level: int, msg: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1.0:
                self._held += 1
                return
            self._tokens -= 1.0
            held, self._held = self._held, 0
        if held:
            msg, args = msg + " (and %d more like it held back)", (*args, held)
        self.logger.log(level, msg, *args)

    def warning(self, msg: str, *args: object) -> None:
        self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: object) -> None:
        self.log(logging.ERROR, msg, *args)
