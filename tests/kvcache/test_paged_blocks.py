"""Block-format payloads: raw block round trips per layout, conversion to tokens, mismatch errors."""

from __future__ import annotations

import os

import pytest
import torch
from _kv_fixtures import BS, HEADS, cpu_layout_cache, reference_kv

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.paged_blocks import (
    blocks_to_tokens,
    extract_request_blocks,
    inject_request_blocks,
    is_block_payload,
)
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.testing.layout_emulator import (
    EmulatedEngine,
    build_caches,
    read_tokens,
    reference_tokens,
    write_tokens,
)

IDS = [7, 2, 9, 4, 0]
SEQ = 140  # 4 full blocks + 12 tokens
DEVICE = os.environ.get("OMNIKV_TEST_DEVICE", "cpu")


def _wire(data: KVCacheTransferData) -> dict:
    return KVCacheTransferData.from_bytes(data.to_bytes())


def _caches(seed: int = 0) -> list[torch.Tensor]:
    """vLLM's CPU-backend caches (``[blocks, heads, block_size, 2 * head_dim]``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(12, HEADS, BS, 2 * 64, generator=g).bfloat16() for _ in range(3)]


def test_block_round_trip_is_byte_exact_and_tokens_match():
    src = _caches(0)
    dst = [torch.zeros_like(c) for c in src]
    data = extract_request_blocks("r", IDS, SEQ, src, metadata={"x": 1})
    got = _wire(data)
    assert is_block_payload(got) and got["metadata"]["x"] == 1
    ident = got["metadata"]["kv_layout"]
    assert (ident["packing"], ident["layout"], ident["dtype"]) == ("kt_v", "LBHNC", "bfloat16")
    dst_ids = [1, 3, 5, 6, 8]
    assert inject_request_blocks(got, dst, dst_ids) == SEQ
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[torch.tensor(IDS)], d[torch.tensor(dst_ids)])
    # token view of the block payload == token extraction from the source cache
    tokens = blocks_to_tokens(got)
    ref = extract_request_kv("r", IDS, SEQ, src, lazy=False)
    for i in range(3):
        assert torch.equal(tokens["layer_blocks"]["key_cache"][i], ref.layer_blocks["key_cache"][i])
        assert torch.equal(
            tokens["layer_blocks"]["value_cache"][i], ref.layer_blocks["value_cache"][i]
        )


def test_cpu_blocks_to_tokens_matches_independent_reference():
    caches = [cpu_layout_cache(i) for i in range(3)]
    tokens = blocks_to_tokens(_wire(extract_request_blocks("r", IDS, SEQ, caches)))
    for i, c in enumerate(caches):
        k, v = reference_kv(c, IDS, SEQ)
        assert torch.equal(tokens["layer_blocks"]["key_cache"][i], k)
        assert torch.equal(tokens["layer_blocks"]["value_cache"][i], v)
        assert tokens["metadata"]["seq_len"] == SEQ


def test_payload_without_its_layout_is_refused():
    """One metadata schema: a paged-blocks payload must carry its layout identity."""
    got = _wire(extract_request_blocks("r", IDS, SEQ, _caches()))
    meta = dict(got["metadata"])
    meta["layouts"] = [meta.pop("kv_layout")] * 3  # the connector's former, second schema
    with pytest.raises(KVPayloadError, match="layout identity"):
        blocks_to_tokens({**got, "metadata": meta})
    meta = {**got["metadata"], "kv_layout": "cpu"}  # the name-only form of earlier releases
    with pytest.raises(KVPayloadError, match="layout identity"):
        blocks_to_tokens({**got, "metadata": meta})


def test_block_payload_is_one_block_per_ceil_tokens():
    data = extract_request_blocks("r", IDS + [11, 10], SEQ, _caches())
    assert data.block_ids == IDS  # only the blocks that hold the tokens
    assert data.layer_blocks["kv_blocks"][0].shape[0] == 5


def test_mismatched_local_cache_is_rejected():
    got = _wire(extract_request_blocks("r", IDS, SEQ, _caches()))
    wrong_dtype = [c.half() for c in _caches()]
    with pytest.raises(KVPayloadError, match="dtype differs"):
        inject_request_blocks(got, wrong_dtype, IDS)
    fewer_heads = [c[:, :1].contiguous() for c in _caches()]
    with pytest.raises(KVPayloadError, match="kv_heads differs"):
        inject_request_blocks(got, fewer_heads, IDS)
    with pytest.raises(KVPayloadError, match="layers"):
        inject_request_blocks(got, _caches()[:2], IDS)
    with pytest.raises(KVPayloadError, match="local blocks"):
        inject_request_blocks(got, _caches(), IDS[:2])


def test_bad_requests_are_rejected():
    with pytest.raises(KVPayloadError, match="need 5 blocks"):
        extract_request_blocks("r", IDS[:3], SEQ, _caches())
    with pytest.raises(KVPayloadError, match="out of range"):
        extract_request_blocks("r", [99], 10, _caches())


# one KV head per rank (MLA; GQA at high TP) between layouts whose intra-block orders
# differ: a page holds the same bytes in both orders, only its shape differs
ONE_HEAD_PAIRS = [
    (("FLASHMLA", "LBNHC"), ("FLASHMLA", "BLHNC")),
    (("FLASHMLA", "BLHNC"), ("FLASHMLA", "LBNHC")),
    (("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBHNC")),
    (("FLASHINFER", "BHLNC"), ("FLASH_ATTN", "BLNHC")),
]


def _one_head(backend: str, layout: str) -> EmulatedEngine:
    return EmulatedEngine(backend=backend, layout=layout, kv_heads=1, head_size=64, device=DEVICE)


def _emulated_ident(e: EmulatedEngine) -> KVLayoutId:
    return EngineLayout(e.block_size, e.layout, e.backend, e.packing == "latent").identity(
        next(iter(build_caches(e).values()))
    )


@pytest.mark.parametrize(("src", "dst"), ONE_HEAD_PAIRS)
def test_layout_one_head_pages_copy_between_page_orders(src: tuple, dst: tuple) -> None:
    """HNC and NHC pages of one head are the same bytes: the page write (the path a GPU
    cache takes) copies them, and the consumer reads every token the producer wrote."""
    s, d = _one_head(*src), _one_head(*dst)
    sid, did = _emulated_ident(s), _emulated_ident(d)
    assert sid.page_order != did.page_order and did.same_pages(sid)
    pc, cc = build_caches(s), build_caches(d)
    src_ids, dst_ids, seq = [7, 2, 9, 4], [1, 5, 0, 8], 100
    ref = reference_tokens(s, seq, seed=3)
    write_tokens(s, pc, src_ids, ref)
    got = _wire(extract_request_blocks("r", src_ids, seq, list(pc.values()), layout=sid))
    assert inject_request_blocks(got, list(cc.values()), dst_ids, layout=did) == seq
    for (rk, rv), (gk, gv) in zip(ref, read_tokens(d, cc, dst_ids, seq), strict=True):
        assert torch.equal(gk, rk)
        assert rv is None and gv is None or torch.equal(gv, rv)
