"""What the engine says about its KV cache, turned into one layout identity per layer.

vLLM 0.32 resolves one ``KVCacheLayout`` per model in the engine core (recorded in
``KVCacheConfig.kv_cache_layout`` and ``cache_config.kv_cache_layout``); the
attention backend decides what a cache entry holds (see
:mod:`vllm_omni_kv.kvcache.cache_layout`). The connector reads both here instead of
guessing from tensor shapes, and checks every registered view against them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.cache_layout import (
    BACKEND_PACKING,
    KVLayoutId,
    check_view,
    dtype_name,
    infer_identity,
    layout_name,
)
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class EngineLayout:
    """The engine facts a layout identity is built from."""

    block_size: int  # tokens per manager block (``cache_config.block_size``)
    layout: str | None = None  # the resolved KVCacheLayout name (None: read from strides)
    backend: str = ""  # the attention backend's name, e.g. "FLASH_ATTN", "CPU_ATTN"
    use_mla: bool = False
    cache_dtype: str = "auto"  # ``cache_config.cache_dtype``

    @property
    def packing(self) -> str:
        if self.use_mla:
            return "latent"
        return BACKEND_PACKING.get(self.backend, "k_v")

    def identity(self, view: torch.Tensor, name: str = "KV cache") -> KVLayoutId:
        """The identity of one registered layer view; ``ConfigError`` when it does not fit."""
        if not isinstance(view, torch.Tensor) or view.dim() != 4:
            raise ConfigError(
                f"layer {name!r}: OmniKVConnector needs vLLM 0.32's 4-D per-layer KV cache "
                f"view [blocks, kv_heads, block_size, C], got "
                f"{tuple(getattr(view, 'shape', ())) or type(view).__name__}"
            )
        kernel = int(view.shape[2])
        if self.block_size % kernel:
            raise ConfigError(
                f"layer {name!r}: kernel block size {kernel} does not divide the block size "
                f"{self.block_size}"
            )
        guess = infer_identity(view, packing=self.packing, block_size=self.block_size)
        ident = dataclasses.replace(
            guess,
            layout=self.layout or guess.layout,
            dtype=dtype_name(view.dtype, self.cache_dtype),
            backend=self.backend,
        )
        check_view(view, ident, f"layer {name!r}")
        return ident


def _backend_name(vllm_config: Any) -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    except Exception as e:  # no attention layers registered (tests), or an older vLLM
        logger.debug("attention backend lookup failed: %s", e)
        names = []
    if len(names) > 1:
        raise ConfigError(
            f"OmniKVConnector supports one attention backend per engine, this one runs {names}"
        )
    if names:
        return str(names[0])
    try:
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else ""
    except Exception:
        return ""


def engine_layout(vllm_config: Any, kv_cache_config: Any = None) -> EngineLayout:
    """Read the engine's layout facts from vLLM's configs (at ``register_kv_caches``)."""
    cache = vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        cache, "kv_cache_layout", None
    )
    model = getattr(vllm_config, "model_config", None)
    return EngineLayout(
        block_size=int(cache.block_size),
        layout=layout_name(str(layout)) if layout else None,
        backend=_backend_name(vllm_config),
        use_mla=bool(getattr(model, "use_mla", False)),
        cache_dtype=str(getattr(cache, "cache_dtype", "auto") or "auto"),
    )
