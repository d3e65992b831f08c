"""Logging through vLLM's ``init_logger`` inside vLLM processes.

vLLM-free stages (a diffusion worker, a benchmark) get a stdlib logger, so
that importing the transfer core never drags in vLLM.
"""

from __future__ import annotations

import logging
import sys


def init_logger(name: str) -> logging.Logger:
    """Return vLLM's configured logger when vLLM is loaded, else a stdlib one."""
    if "vllm" in sys.modules:
        try:
            from vllm.logger import init_logger as _vllm_init_logger

            return _vllm_init_logger(name)
        except Exception:  # pragma: no cover - partially initialised vLLM
            pass
    return logging.getLogger(name)
