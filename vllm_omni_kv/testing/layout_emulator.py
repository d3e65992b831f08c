"""A vLLM 0.32 KV cache emulator: per-layer caches built exactly as vLLM builds them, and
per-token K/V written and read the way vLLM's attention backends do.

``build_caches`` uses vLLM's own ``compute_layout_strides`` / ``create_kv_cache_views``
(and the ``KVCacheTensor`` placement of ``get_kv_cache_config_from_groups``) when vLLM
is importable, else a transcription of them (a GPU machine without vLLM); the tests
check that both agree. ``write_tokens`` / ``read_tokens`` address one token's K and V
the way the kernels do, by slot (``block * block_size + offset``), independently of
``vllm_omni_kv.kvcache``:

* FlashAttention / FlashInfer / Triton: ``kv_cache.transpose(1, 2).split(head_size, -1)``
  on kernel block ``slot // kernel_block_size``.
* CPU: per (kernel block, head), K transposed (``[head_size, block_size]``) then V.
* MLA: one latent vector per token, ``kv_cache.transpose(1, 2)``.

Values are random bit patterns of the element size, so comparisons are exact for
every dtype (fp8 included).

A hybrid engine (``sliding_window`` set) has two KV cache groups as vLLM's hybrid KV
cache manager lays them out: even layers attend to a sliding window (group 0), odd
layers to every token (group 1), and layer ``2j + g`` of group ``g`` aliases the
``j``-th view of the one backing allocation (groups alias from byte 0). The token
helpers then take one block table per group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from vllm_omni_kv.kvcache.cache_layout import LAYOUT_ORDERS

#: vLLM's KVCacheLayout members (checked against vLLM's enum in the tests)
ORDERS = LAYOUT_ORDERS
#: torch storage dtype of vLLM's cache for each KV dtype (fp8 caches are uint8 bytes)
STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.uint8}
#: what each emulated backend stores per cache entry
PACKING = {
    "CPU_ATTN": "kt_v",
    "FLASH_ATTN": "k_v",
    "FLASHINFER": "k_v",
    "TRITON_ATTN": "k_v",
    "FLASHMLA": "latent",
}
_INT = {1: torch.uint8, 2: torch.int16}


@dataclass(frozen=True)
class EmulatedEngine:
    """One engine's KV cache configuration."""

    backend: str = "FLASH_ATTN"
    layout: str = "LBNHC"
    dtype: str = "bfloat16"
    num_layers: int = 2
    num_blocks: int = 10
    block_size: int = 32
    kernel_block_size: int | None = None
    kv_heads: int = 2
    head_size: int = 32  # the latent width for MLA
    device: str = "cpu"
    sliding_window: int | None = None  # hybrid: tokens of group 0's window

    @property
    def groups(self) -> int:
        """KV cache groups: 2 for a hybrid engine (sliding window, full), else 1."""
        return 1 if self.sliding_window is None else 2

    def group_of(self, layer: int) -> int:
        return layer % self.groups

    @property
    def packing(self) -> str:
        return PACKING[self.backend]

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def heads(self) -> int:
        return 1 if self.packing == "latent" else self.kv_heads

    @property
    def cache_dtype(self) -> str:
        """vLLM's ``cache_config.cache_dtype`` for this engine."""
        return "fp8_e4m3" if self.dtype.startswith("fp8") else "auto"

    @property
    def content_bytes(self) -> int:
        per = 1 if self.packing == "latent" else 2
        return per * self.head_size * torch.empty((), dtype=STORAGE[self.dtype]).element_size()

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]


def _page_bytes(e: EmulatedEngine) -> int:
    return e.heads * e.block_size * e.content_bytes


def _one_group(e: EmulatedEngine) -> EmulatedEngine:
    """The layers one group's views cover (every layer for a single-group engine)."""
    return dataclasses.replace(e, num_layers=e.num_layers // e.groups, sliding_window=None)


def kv_cache_config(e: EmulatedEngine) -> Any:
    """vLLM's ``KVCacheConfig`` groups of ``e`` (the fields a connector reads, where vLLM
    is not importable)."""
    names = e.layer_names()
    members = [[n for i, n in enumerate(names) if e.group_of(i) == g] for g in range(e.groups)]
    if not have_vllm():
        by_layer = {n: g for g, layers in enumerate(members) for n in layers}
        return SimpleNamespace(
            transfer_group_index_by_layer=by_layer, transfer_group_ids=tuple(range(e.groups))
        )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw = dict(block_size=e.block_size, num_kv_heads=e.kv_heads, head_size=e.head_size,
              dtype=STORAGE[e.dtype])  # fmt: skip
    specs: list[Any] = [FullAttentionSpec(**kw)]
    if e.sliding_window is not None:
        specs.insert(0, SlidingWindowSpec(**kw, sliding_window=e.sliding_window))
    groups = [KVCacheGroupSpec(m, spec) for m, spec in zip(members, specs, strict=True)]
    return KVCacheConfig(num_blocks=e.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _placement(e: EmulatedEngine) -> tuple[int, int | None]:
    """``(size, fixed block stride)`` of the backing allocation, as
    ``get_kv_cache_config_from_groups`` places one group of same-shaped layers: a
    block-outermost layout packs every layer's page of a block together."""
    page = _page_bytes(e)
    outer = ORDERS[e.layout][0] == 1
    return page * e.num_layers * e.num_blocks, page * e.num_layers if outer else None


def _strides(
    e: EmulatedEngine, num_blocks: int, fixed: tuple[int | None, ...], kernel: int
) -> tuple[int, ...]:
    """Byte strides of logical ``[L, B, H, N, C]`` (vLLM's ``compute_layout_strides``)."""
    ratio = e.block_size // kernel
    shape = (e.num_layers, num_blocks * ratio, e.heads, kernel, e.content_bytes)
    strides = [0] * 5
    cur = 1
    for dim in reversed(ORDERS[e.layout]):
        strides[dim] = fixed[dim] or cur
        cur = strides[dim] * shape[dim]
    return tuple(strides)


def _views_without_vllm(e: EmulatedEngine, raw: torch.Tensor) -> list[torch.Tensor]:
    _size, fixed_block = _placement(e)
    placed = _strides(e, e.num_blocks, (None, fixed_block, None, None, None), e.block_size)
    layer_stride, block_stride = placed[0], placed[1]
    ratio = e.block_size // e.kernel
    if ratio > 1:
        if block_stride != _page_bytes(e):
            raise ValueError(f"{e.layout} cannot split blocks into kernel blocks")
        block_stride //= ratio
    fixed = (layer_stride, block_stride, None, None, None)
    strides = _strides(e, e.num_blocks, fixed, kernel=e.kernel)
    shape = (e.num_layers, e.num_blocks * ratio, e.heads, e.kernel, e.content_bytes)
    v5 = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return [v5[i].view(STORAGE[e.dtype]) for i in range(e.num_layers)]


def _views_with_vllm(e: EmulatedEngine, raw: torch.Tensor) -> list[torch.Tensor]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[e.layout]
    dtype = STORAGE[e.dtype]
    spec: Any
    if e.packing == "latent":
        spec = MLAAttentionSpec(
            block_size=e.block_size, num_kv_heads=1, head_size=e.head_size, dtype=dtype
        )
    else:
        spec = FullAttentionSpec(
            block_size=e.block_size, num_kv_heads=e.kv_heads, head_size=e.head_size, dtype=dtype
        )
    size, fixed_block = _placement(e)
    layer_stride, block_stride, _h, _n, _c = compute_layout_strides(
        spec,
        e.num_blocks,
        e.num_layers,
        layout,
        fixed_strides=(None, fixed_block, None, None, None),
    )
    tensor = KVCacheTensor(
        size=size, layers=e.layer_names(), layer_stride=layer_stride, block_stride=block_stride
    )
    kernel = e.kernel if e.kernel != e.block_size else None
    return create_kv_cache_views(raw, spec, e.num_blocks, layout, tensor, kernel_block_size=kernel)


def have_vllm() -> bool:
    try:
        import vllm.v1.kv_cache_interface  # noqa: F401
    except Exception:
        return False
    return True


def build_caches(e: EmulatedEngine, *, use_vllm: bool | None = None) -> dict[str, torch.Tensor]:
    """Per-layer 4-D views over one zeroed backing allocation, as vLLM's ``allocate_kv_cache``
    (a hybrid engine's groups alias the same views)."""
    one = _one_group(e)
    size, _fixed = _placement(one)
    raw = torch.zeros(size, dtype=torch.int8, device=e.device)
    vllm_ok = have_vllm() if use_vllm is None else use_vllm
    views = _views_with_vllm(one, raw) if vllm_ok else _views_without_vllm(one, raw)
    return {name: views[i // e.groups] for i, name in enumerate(e.layer_names())}


def reference_tokens(
    e: EmulatedEngine, num_tokens: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per layer, K and V (``[tokens, heads, head_size]`` integer bit patterns; V None for
    MLA) that a prefill of ``num_tokens`` tokens would store."""
    g = torch.Generator().manual_seed(seed)
    idt = _INT[STORAGE[e.dtype].itemsize]
    lo, hi = (0, 255) if idt == torch.uint8 else (-(2**15), 2**15 - 1)
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for _ in range(e.num_layers):
        shape = (num_tokens, e.heads, e.head_size)
        k = torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(idt)
        v = None
        if e.packing != "latent":
            v = torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(idt)
        out.append((k, v))
    return out


def _tables(e: EmulatedEngine, block_ids: Sequence[Any]) -> list[list[int]]:
    """Each layer's block table: ``block_ids`` (one table), or a hybrid engine's table
    of the layer's group."""
    if e.groups == 1:
        return [list(block_ids)] * e.num_layers
    return [list(block_ids[e.group_of(i)]) for i in range(e.num_layers)]


def _slot(e: EmulatedEngine, block_ids: list[int], t: int) -> tuple[int, int]:
    """(kernel block, offset in it) of token ``t`` of a request with ``block_ids``."""
    slot = block_ids[t // e.block_size] * e.block_size + t % e.block_size
    return slot // e.kernel, slot % e.kernel


def _cell(e: EmulatedEngine, layer: torch.Tensor, kb: int, off: int, h: int) -> tuple[Any, Any]:
    """Writable ``(K, V)`` of one (kernel block, offset, head) as the kernels address them."""
    d = e.head_size
    if e.packing == "kt_v":
        flat = layer[kb, h].reshape(-1)  # LBHNC: a (block, head) row is dense
        n = e.kernel
        return flat[0 : d * n].view(d, n)[:, off], flat[d * n + off * d : d * n + off * d + d]
    entry = layer.transpose(1, 2)[kb, off, h]
    if e.packing == "latent":
        return entry, None
    return entry[:d], entry[d:]


def write_tokens(
    e: EmulatedEngine,
    caches: dict[str, torch.Tensor],
    block_ids: Sequence[Any],
    ref: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> None:
    """Store ``ref`` tokens into the request's blocks (what a forward pass would write)."""
    idt = _INT[STORAGE[e.dtype].itemsize]
    tables = _tables(e, block_ids)
    for layer, table, (k, v) in zip(caches.values(), tables, ref, strict=True):
        bits = layer.view(idt)
        for t in range(k.shape[0]):
            kb, off = _slot(e, table, t)
            for h in range(e.heads):
                ck, cv = _cell(e, bits, kb, off, h)
                ck.copy_(k[t, h])
                if cv is not None and v is not None:
                    cv.copy_(v[t, h])


def read_tokens(
    e: EmulatedEngine, caches: dict[str, torch.Tensor], block_ids: Sequence[Any], num_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Read tokens ``[0, num_tokens)`` back from the request's blocks (CPU tensors)."""
    idt = _INT[STORAGE[e.dtype].itemsize]
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for layer, table in zip(caches.values(), _tables(e, block_ids), strict=True):
        bits = layer.view(idt)
        k = torch.empty(num_tokens, e.heads, e.head_size, dtype=idt)
        v = None if e.packing == "latent" else torch.empty_like(k)
        for t in range(num_tokens):
            kb, off = _slot(e, table, t)
            for h in range(e.heads):
                ck, cv = _cell(e, bits, kb, off, h)
                k[t, h] = ck.cpu()
                if v is not None:
                    v[t, h] = cv.cpu()
        out.append((k, v))
    return out
