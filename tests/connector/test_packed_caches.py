"""Quantized and backend-packed KV caches (NVFP4, TurboQuant, per-token-head scales, separate
K/V planes): the layer identity comes from vLLM's KV cache spec, never from the view's shape.

Caches are allocated by vLLM's own ``allocate_kv_cache`` from specs its attention backends
customize (``customize_spec``), as a GPU engine registers them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.connector.engine_layout import EngineLayout, engine_layout
from vllm_omni_kv.connector.receive import layer_caches
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.paged_blocks import (
    blocks_to_tokens,
    extract_request_blocks,
    inject_request_blocks,
)

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")

BS, HEADS, HEAD, BLOCKS = 16, 2, 128, 12
IDS, SEQ = [7, 2, 9], 40


def _base(cache_dtype: str, dtype: torch.dtype) -> object:
    return kvi.FullAttentionSpec(
        block_size=BS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=dtype,
        kv_quant_mode=kvi.get_kv_quant_mode(cache_dtype),
    )


def _turboquant() -> object:
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    return TurboQuantAttentionBackend.customize_spec(_base("turboquant_k8v4", torch.uint8))


def _per_token_head() -> object:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend.customize_spec(_base("int8_per_token_head", torch.int8))


def _nvfp4() -> object:
    # FlashInferBackend.customize_spec (flashinfer is not importable without CUDA)
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim

    return dataclasses.replace(
        _base("nvfp4", torch.uint8),
        num_head_slots=2 * HEADS,
        state_content_bytes=nvfp4_kv_cache_full_dim(HEAD),
    )


def _planes() -> object:
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend

    return RocmAttentionBackend.customize_spec(_base("auto", torch.bfloat16))


#: (backend name, cache_dtype, spec builder)
PACKED = {
    "turboquant": ("TURBOQUANT", "turboquant_k8v4", _turboquant),
    "int8-per-token-head": ("TRITON_ATTN", "int8_per_token_head", _per_token_head),
    "nvfp4": ("FLASHINFER", "nvfp4", _nvfp4),
    "rocm-kv-planes": ("ROCM_ATTN", "auto", _planes),
}


def _engine(
    spec: object, backend: str, cache_dtype: str, layout: str = "LBNHC"
) -> tuple[EngineLayout, dict[str, torch.Tensor]]:
    """vLLM's caches for ``spec`` and the connector's engine facts read from vLLM's configs
    (the attention backend named: its lookup needs a running engine)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    lay = KVCacheLayout[layout]
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    fixed = (None, page * 2 if lay.is_block_outermost else None, None, None, None)
    strides = kvi.compute_layout_strides(spec, BLOCKS, 2, lay, fixed_strides=fixed)
    tensor = kvi.KVCacheTensor(page * BLOCKS * 2, names, strides[0], strides[1])
    cfg = kvi.KVCacheConfig(BLOCKS, [tensor], [kvi.KVCacheGroupSpec(names, spec)])
    cfg.kv_cache_layout = layout
    caches = allocate_kv_cache(cfg, torch.device("cpu"), lay)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(use_mla=False),
    )
    facts = dataclasses.replace(engine_layout(vllm_config, cfg), backend=backend)
    return facts, caches


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_cache_is_identified_from_the_spec(name: str) -> None:
    backend, cache_dtype, build = PACKED[name]
    spec = build()
    facts, caches = _engine(spec, backend, cache_dtype)
    layers = layer_caches(caches, facts)
    ident = layers[0].ident
    assert ident.packing == "packed", ident.describe()
    assert ident.kv_heads == spec.num_heads  # type: ignore[attr-defined]
    assert ident.content * ident.element_size == spec.state_content_size_bytes  # type: ignore[attr-defined]
    assert all(x.kv is None for x in layers)  # no per-token K/V view of opaque cells


def test_packed_cache_dtype_without_a_spec_is_not_k_v() -> None:
    """An engine that names a packed cache dtype but no spec is never read as K|V."""
    _facts, caches = _engine(_nvfp4(), "FLASHINFER", "nvfp4")
    ident = EngineLayout(BS, "LBNHC", "FLASHINFER", cache_dtype="nvfp4").identity(
        next(iter(caches.values()))
    )
    assert ident.packing == "packed"


def test_a_dense_spec_is_k_v_with_the_specs_head_size() -> None:
    facts, caches = _engine(_base("auto", torch.bfloat16), "FLASH_ATTN", "auto")
    ident = layer_caches(caches, facts)[0].ident
    assert (ident.packing, ident.kv_heads, ident.head_size) == ("k_v", HEADS, HEAD)


def test_states_of_several_tokens_are_refused_at_registration() -> None:
    spec = dataclasses.replace(_turboquant(), tokens_per_state=4)
    facts, caches = _engine(spec, "TURBOQUANT", "turboquant_k8v4")
    with pytest.raises(ConfigError, match="tokens per stored state"):
        layer_caches(caches, facts)


def _fill(caches: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(5)
    for c in caches.values():
        b = c.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def _payload(facts: EngineLayout, caches: dict[str, torch.Tensor]) -> dict:
    ident = layer_caches(caches, facts)[0].ident
    data = extract_request_blocks("r", IDS, SEQ, list(caches.values()), layout=ident)
    return KVCacheTransferData.from_bytes(data.to_bytes())


def test_packed_pages_copy_byte_for_byte_between_identical_engines() -> None:
    backend, cache_dtype, build = PACKED["turboquant"]
    src_facts, src = _engine(build(), backend, cache_dtype)
    dst_facts, dst = _engine(build(), backend, cache_dtype, layout="BLNHC")  # same page order
    _fill(src)
    got = _payload(src_facts, src)
    dst_ident = layer_caches(dst, dst_facts)[0].ident
    assert inject_request_blocks(got, list(dst.values()), [1, 4, 0], layout=dst_ident) == SEQ
    for s, d in zip(src.values(), dst.values(), strict=True):
        assert torch.equal(s[torch.tensor(IDS)], d[torch.tensor([1, 4, 0])])


@pytest.mark.parametrize(
    ("dst", "why"),
    [
        (("turboquant", "LBHNC"), "packed"),  # other intra-block order: no conversion
        (("nvfp4", "LBNHC"), "differs"),
        (("rocm-kv-planes", "LBNHC"), "differs"),
    ],
)
def test_packed_pages_are_never_converted(dst: tuple[str, str], why: str) -> None:
    backend, cache_dtype, build = PACKED["turboquant"]
    src_facts, src = _engine(build(), backend, cache_dtype)
    _fill(src)
    got = _payload(src_facts, src)
    d_backend, d_dtype, d_build = PACKED[dst[0]]
    dst_facts, caches = _engine(d_build(), d_backend, d_dtype, layout=dst[1])
    dst_ident = layer_caches(caches, dst_facts)[0].ident
    with pytest.raises(KVPayloadError, match=why):
        inject_request_blocks(got, list(caches.values()), [1, 4, 0], layout=dst_ident)
    assert all(int(c.view(torch.uint8).count_nonzero()) == 0 for c in caches.values())
    with pytest.raises(KVPayloadError, match="no K/V"):
        blocks_to_tokens(got)
