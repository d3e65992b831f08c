"""Public re-export of :mod:`vllm_omni_kv.kvcache.kv_utils` (``vllm_omni_kv.kv_utils.*``)."""

from __future__ import annotations

from vllm_omni_kv.kvcache import kv_utils as _impl
from vllm_omni_kv.kvcache.kv_utils import *  # noqa: F403

__all__ = list(_impl.__all__)
