"""Paged-blocks payloads whose layers keep different blocks (hybrid KV cache groups)."""

from __future__ import annotations

import pytest
import torch
from _kv_fixtures import BS, cpu_layout_cache, reference_kv

from vllm_omni_kv import KVCacheTransferData, KVPayloadError
from vllm_omni_kv.kvcache.layer_windows import LAYER_FIRST_BLOCKS, kept_from
from vllm_omni_kv.kvcache.paged_blocks import (
    blocks_to_tokens,
    extract_request_blocks,
    inject_request_blocks,
)

SEQ = 150  # 5 blocks, the last one partial
FULL_IDS = [3, 8, 1, 6, 9]
WINDOW_IDS = [0, 0, 0, 4, 11]  # a sliding-window group: the null block before its window


def _wire(data: KVCacheTransferData) -> dict:
    return KVCacheTransferData.from_bytes(data.to_bytes())


def _payload() -> tuple[list[torch.Tensor], dict]:
    """Two layers: layer 0 keeps every block, layer 1 the last two."""
    src = [cpu_layout_cache(i, seed=5) for i in range(2)]
    data = extract_request_blocks(
        "r",
        FULL_IDS,
        SEQ,
        src,
        layer_ids=[FULL_IDS, WINDOW_IDS],
        layer_first=[0, 3],
    )
    return src, _wire(data)


def test_kept_from_skips_every_null_block() -> None:
    assert kept_from([0, 0, 5, 6], 0, 4) == 2
    assert kept_from([0, 0, 5, 6], 3, 4) == 3  # a local prefix past the window's start
    assert kept_from([7, 5, 6], 0, 3) == 0
    assert kept_from([0, 0, 5, 0], 0, 3) == 2  # only the blocks that hold tokens count


def test_each_layer_carries_only_its_kept_blocks() -> None:
    _src, got = _payload()
    pages = got["layer_blocks"]["kv_blocks"]
    assert [int(p.shape[0]) for p in pages] == [5, 2]
    assert got["metadata"][LAYER_FIRST_BLOCKS] == [0, 3]


def test_each_layer_lands_in_its_own_table() -> None:
    src, got = _payload()
    dst = [torch.zeros_like(c) for c in src]
    full, window = [2, 5, 7, 10, 4], [0, 0, 0, 1, 3]
    n = inject_request_blocks(got, dst, full, layer_ids=[full, window], layer_first=[0, 3])
    assert n == SEQ
    k, v = reference_kv(dst[0], full, SEQ)
    rk, rv = reference_kv(src[0], FULL_IDS, SEQ)
    assert torch.equal(k, rk) and torch.equal(v, rv)
    k, v = reference_kv(dst[1], window, SEQ)
    rk, rv = reference_kv(src[1], WINDOW_IDS, SEQ)
    assert torch.equal(k[3 * BS :], rk[3 * BS :]) and torch.equal(v[3 * BS :], rv[3 * BS :])
    assert not dst[1][0].any()  # the null block is never written
    untouched = [b for b in range(dst[1].shape[0]) if b not in (1, 3)]
    assert not dst[1][untouched].any()


def test_a_layer_needing_blocks_the_payload_lacks_is_refused() -> None:
    src, got = _payload()
    dst = [torch.zeros_like(c) for c in src]
    with pytest.raises(KVPayloadError, match="different windows"):
        inject_request_blocks(got, dst, FULL_IDS, layer_ids=[FULL_IDS, FULL_IDS])


def test_a_malformed_first_blocks_field_is_refused() -> None:
    src, got = _payload()
    dst = [torch.zeros_like(c) for c in src]
    for bad in ([0], [0, 5], [0, -1], "03"):
        md = {**got["metadata"], LAYER_FIRST_BLOCKS: bad}
        with pytest.raises(KVPayloadError, match=LAYER_FIRST_BLOCKS):
            inject_request_blocks({**got, "metadata": md}, dst, FULL_IDS)


def test_a_windowed_payload_has_no_token_major_form() -> None:
    _src, got = _payload()
    with pytest.raises(KVPayloadError, match="token-major"):
        blocks_to_tokens(got)
