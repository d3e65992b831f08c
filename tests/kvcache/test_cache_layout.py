"""Layout identities and cache views (``vllm_omni_kv.kvcache.cache_layout``), checked
against vLLM's own ``KVCacheLayout`` and backend split where vLLM is installed."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import (
    LAYOUT_ORDERS,
    KVLayoutId,
    check_view,
    infer_identity,
    layout_name,
    page_order,
    token_views,
)
from vllm_omni_kv.kvcache.kv_utils import normalize_layer_kv
from vllm_omni_kv.testing.layout_emulator import EmulatedEngine, build_caches, have_vllm

DEVICE = os.environ.get("OMNIKV_TEST_DEVICE", "cpu")


def _ident(**kw: object) -> KVLayoutId:
    base: dict[str, object] = dict(
        packing="k_v",
        layout="LBNHC",
        dtype="bfloat16",
        block_size=32,
        kernel_block_size=32,
        kv_heads=2,
        head_size=64,
        element_size=2,
        backend="FLASH_ATTN",
    )
    return KVLayoutId(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.skipif(not have_vllm(), reason="compares with vLLM's KVCacheLayout")
def test_layout_orders_are_vllms() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.value for m in KVCacheLayout} == LAYOUT_ORDERS
    for m in KVCacheLayout:  # HNC/NHC inside a block, as vLLM's layer view order says
        view = m.layer_view_order
        assert page_order(m.name) == ("HNC" if view.index(1) < view.index(2) else "NHC")


def test_layout_names_and_aliases() -> None:
    assert layout_name("NHD") == "LBNHC" and layout_name("HND") == "LBHNC"
    with pytest.raises(ConfigError, match="unknown KV cache layout"):
        layout_name("XYZ")


def test_layout_identity_round_trips_and_compares() -> None:
    a = _ident()
    assert KVLayoutId.from_dict(a.to_dict()) == a
    # the outer L/B order does not change a page's bytes; the intra-block order does
    assert a.same_pages(_ident(layout="BLNHC", backend="TRITON_ATTN"))
    assert not a.same_pages(_ident(layout="LBHNC"))
    assert a.conversion_refusal(_ident(layout="LBHNC", kernel_block_size=16)) is None
    assert a.conversion_refusal(_ident(packing="kt_v", layout="LBHNC")) is None
    assert "dtype differs" in str(a.conversion_refusal(_ident(dtype="float16")))
    assert "head_size differs" in str(a.conversion_refusal(_ident(head_size=128)))
    mla = _ident(packing="latent", kv_heads=1, head_size=576)
    assert "latent" in str(_ident(kv_heads=1, head_size=576).conversion_refusal(mla))
    with pytest.raises(KVPayloadError, match="layout identity"):
        KVLayoutId.from_dict({"packing": "k_v"})
    with pytest.raises(ConfigError, match="CPU packing exists only in LBHNC"):
        _ident(packing="kt_v", layout="LBNHC")


def test_identities_read_again_are_shared_yet_checked_each_time() -> None:
    """``from_dict`` keeps the identities it read: the same fields give the same frozen
    object, and a mapping that differs only in a field's type is still refused."""
    d = _ident().to_dict()
    assert KVLayoutId.from_dict(dict(d)) is KVLayoutId.from_dict(dict(d))
    for field, bad in (("element_size", True), ("block_size", 16.0), ("dtype", 7)):
        with pytest.raises(KVPayloadError, match=f"field {field!r}"):
            KVLayoutId.from_dict({**d, field: bad})
    with pytest.raises(KVPayloadError, match="invalid"):  # refused the same way twice
        KVLayoutId.from_dict({**d, "kernel_block_size": 5})
    with pytest.raises(KVPayloadError, match="invalid"):
        KVLayoutId.from_dict({**d, "kernel_block_size": 5})
    assert KVLayoutId.from_dict({**d, "unknown": [1]}) == _ident()


def test_layout_flash_split_is_vllms() -> None:
    """K is C[..., :D] and V C[..., D:] per token, as FlashAttention splits the view."""
    e = EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC", device=DEVICE)
    view = next(iter(build_caches(e).values()))
    view.copy_(torch.randn(view.shape, device=DEVICE).to(view.dtype))
    k, v = token_views(view, infer_identity(view, packing="k_v"))
    ref_k, ref_v = view.transpose(1, 2).split(e.head_size, dim=-1)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert k.data_ptr() == view.data_ptr()  # views, no copy
    # kv_utils' API with the identity: [blocks, block_size, heads, head_size] views
    nk, nv = normalize_layer_kv(view, layout=infer_identity(view, packing="k_v"))
    assert torch.equal(nk, ref_k) and torch.equal(nv, ref_v)


def test_layout_view_checks_name_the_problem() -> None:
    view = torch.zeros(8, 32, 2, 128, device=DEVICE).transpose(1, 2)  # LBNHC strides
    assert infer_identity(view, packing="k_v").layout == "LBNHC"
    with pytest.raises(ConfigError, match="not in LBHNC order"):
        check_view(view, _ident(layout="LBHNC", dtype="float32", element_size=4))
    with pytest.raises(ConfigError, match="expected vLLM's"):
        check_view(view, _ident(kv_heads=4, dtype="float32", element_size=4))
    with pytest.raises(KVPayloadError, match="4-D"):
        infer_identity(torch.zeros(2, 8, 32, 2, 64))
