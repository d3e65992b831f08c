"""This worker's TP rank, TP world size and Omni replica id.

vLLM is looked up lazily (never imported here): outside a vLLM TP group the
helpers return single-process defaults.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vllm_omni_kv.errors import ConfigError

__all__ = ["REPLICA_ID_ENV", "get_local_tp_rank", "get_omni_replica_id", "get_tp_world_size"]

#: Environment variable holding the Omni replica id of this process.
REPLICA_ID_ENV = "VLLM_OMNI_REPLICA_ID"


def _vllm_parallel_state() -> Any | None:
    # vLLM's TP group can only exist if vLLM's parallel_state was imported.
    if sys.modules.get("vllm.distributed.parallel_state") is None:
        return None
    try:
        from vllm.distributed import parallel_state
    except ImportError:  # pragma: no cover - partially importable vLLM
        return None
    if getattr(parallel_state, "_TP", None) is None:
        return None
    return parallel_state


def get_local_tp_rank() -> int:
    """Return the TP-local rank of this worker process (0 outside vLLM TP).

    Uses get_tensor_model_parallel_rank() which returns the rank within the TP
    group only, not the stage-global rank.
    """
    ps = _vllm_parallel_state()
    if ps is None:
        return 0
    try:
        return int(ps.get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError, RuntimeError):
        return 0


def get_tp_world_size() -> int:
    """Return the TP world size (tensor-parallel dimension only; 1 outside vLLM TP).

    Uses get_tensor_model_parallel_world_size() so that cfg_parallel, SP, PP
    etc. are not included in the count.
    """
    ps = _vllm_parallel_state()
    if ps is None:
        return 1
    try:
        return int(ps.get_tensor_model_parallel_world_size())
    except (AssertionError, AttributeError, RuntimeError):
        return 1


def get_omni_replica_id() -> int:
    """Return the Omni replica id: env ``VLLM_OMNI_REPLICA_ID`` or 0.

    Raises ConfigError when the variable is set but not an int >= 0.
    """
    raw = os.environ.get(REPLICA_ID_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{REPLICA_ID_ENV} must be an int, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{REPLICA_ID_ENV} must be >= 0, got {value}")
    return value
