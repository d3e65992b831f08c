"""Block-format payloads: raw block round trips per layout, conversion to tokens, mismatch errors."""

from __future__ import annotations

import pytest
import torch
from _kv_fixtures import BS, HEADS, cpu_layout_cache, reference_kv

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.kvcache.paged_blocks import (
    blocks_to_tokens,
    extract_request_blocks,
    inject_request_blocks,
    is_block_payload,
)
from vllm_omni_kv.kvcache.token_major import extract_request_kv

IDS = [7, 2, 9, 4, 0]
SEQ = 140  # 4 full blocks + 12 tokens


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
