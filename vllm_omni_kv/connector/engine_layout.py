"""What the engine says about its KV cache, turned into one layout identity per layer.

vLLM 0.32 resolves one ``KVCacheLayout`` per model in the engine core (recorded in
``KVCacheConfig.kv_cache_layout`` and ``cache_config.kv_cache_layout``); the
attention backend decides what a cache entry holds (see
:mod:`vllm_omni_kv.kvcache.cache_layout`), and each layer's ``KVCacheSpec`` (in
``KVCacheConfig.kv_cache_groups``) says whether an entry is dense K|V (or an MLA
latent) or a packed cell: quantization modes other than per-tensor fp8, backend head
slots or content bytes (``num_head_slots``, ``state_content_bytes``). The connector reads
these here instead of guessing from tensor shapes, and checks every registered view
against them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_kv.connector.state_layers import StateSpecs, state_specs
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

#: ``cache_config.cache_dtype`` values whose cache holds dense K|V (or latent) elements
DENSE_CACHE_DTYPES = frozenset(
    {"auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"}
)
#: ``KVQuantMode`` names whose cache holds dense elements (per-tensor scales live elsewhere)
DENSE_QUANT_MODES = frozenset({"NONE", "FP8_PER_TENSOR"})


@dataclass(frozen=True)
class SpecFacts:
    """What one layer's ``AttentionSpec`` says about its cache entries."""

    head_size: int
    head_size_v: int
    quant_mode: str = "NONE"  # the ``KVQuantMode`` member name
    head_slots: int | None = None  # ``num_head_slots``: H when it is not the KV heads
    content_bytes: int | None = None  # ``state_content_bytes``: C when packed
    tokens_per_state: float = 1.0

    def packed_reason(self, mla: bool) -> str | None:
        """Why an entry is an opaque packed cell rather than K|V or a latent (None: it is not)."""
        if self.quant_mode not in DENSE_QUANT_MODES:
            return f"quantization {self.quant_mode}"
        if self.head_slots is not None or self.content_bytes is not None:
            return "the backend packs its head slots or content"
        if not mla and self.head_size_v != self.head_size:
            return f"K and V widths differ ({self.head_size} vs {self.head_size_v})"
        return None


def spec_facts(kv_cache_config: Any) -> dict[str, SpecFacts]:
    """Per layer name, the facts of vLLM's attention spec in ``kv_cache_config``."""
    out: dict[str, SpecFacts] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        pairs = per_layer.items() if per_layer else ((n, spec) for n in group.layer_names)
        for name, s in pairs:
            if getattr(s, "head_size", None) is None:
                continue  # not attention (e.g. Mamba state)
            mode = getattr(s, "kv_quant_mode", None)
            out[name] = SpecFacts(
                head_size=int(s.head_size),
                head_size_v=int(getattr(s, "head_size_v", None) or 0),
                quant_mode=str(getattr(mode, "name", None) or "NONE"),
                head_slots=getattr(s, "num_head_slots", None),
                content_bytes=getattr(s, "state_content_bytes", None),
                tokens_per_state=float(getattr(s, "tokens_per_state", 1) or 1),
            )
    return out


@dataclass(frozen=True)
class EngineLayout:
    """The engine facts a layout identity is built from."""

    block_size: int  # tokens per manager block (``cache_config.block_size``)
    layout: str | None = None  # the resolved KVCacheLayout name (None: read from strides)
    backend: str = ""  # the attention backend's name, e.g. "FLASH_ATTN", "CPU_ATTN"
    use_mla: bool = False
    cache_dtype: str = "auto"  # ``cache_config.cache_dtype``
    #: per layer name, its attention spec's facts (empty: vLLM gave no KVCacheConfig)
    specs: Mapping[str, SpecFacts] = field(default_factory=dict, hash=False)
    #: per state layer name (Mamba / GDN / short conv), its identity and block size
    states: StateSpecs = field(default_factory=dict, hash=False)

    def spec(self, name: str) -> SpecFacts | None:
        """The facts of layer ``name``, or the one set every layer shares."""
        if name in self.specs:
            return self.specs[name]
        distinct = set(self.specs.values())
        return distinct.pop() if len(distinct) == 1 else None

    def packed_reason(self, name: str = "") -> str | None:
        """Why layer ``name`` holds packed cells (None: dense K|V or an MLA latent)."""
        facts = self.spec(name)
        if facts is not None:
            why = facts.packed_reason(self.use_mla)
            if why is not None:
                return why
        if self.cache_dtype not in DENSE_CACHE_DTYPES:
            return f"cache dtype {self.cache_dtype}"
        return None

    def packing(self, name: str = "") -> str:
        if self.packed_reason(name) is not None:
            return "packed"
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
        facts = self.spec(name)
        if facts is not None and facts.tokens_per_state != 1:
            raise ConfigError(
                f"layer {name!r}: {facts.tokens_per_state:g} tokens per stored state; "
                "OmniKVConnector moves caches that store one state per token"
            )
        packing = self.packing(name)
        guess = infer_identity(view, packing=packing, block_size=self.block_size)
        ident = dataclasses.replace(
            guess,
            layout=self.layout or guess.layout,
            dtype=dtype_name(view.dtype, self.cache_dtype),
            backend=self.backend,
        )
        if facts is not None and packing in ("k_v", "kt_v", "latent"):
            # the spec's head size, so a view whose C does not match it fails the check
            ident = dataclasses.replace(ident, head_size=facts.head_size)
        check_view(view, ident, f"layer {name!r}")
        return ident


def _backend_name(vllm_config: Any, layer_names: list[str] | None = None) -> str:
    """The attention backend of ``layer_names`` (None: of every layer)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(vllm_config, layer_names)
        names = sorted({b.get_name() for b in backends})
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
    specs = spec_facts(kv_cache_config)
    states = state_specs(vllm_config, kv_cache_config)
    return EngineLayout(
        block_size=int(cache.block_size),
        layout=layout_name(str(layout)) if layout else None,
        # the attention layers' backend (state layers run their own, e.g. GDN_ATTN)
        backend=_backend_name(vllm_config, sorted(specs) if states and specs else None),
        use_mla=bool(getattr(model, "use_mla", False)),
        cache_dtype=str(getattr(cache, "cache_dtype", "auto") or "auto"),
        specs=specs,
        states=states,
    )
