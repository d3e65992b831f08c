"""Writing pages of one layout identity into a cache of another, token by token (CPU vs
FlashAttention packing, NHD vs HND, other kernel blocks: conversions without loss)."""

from __future__ import annotations

import torch

from vllm_omni_kv.kvcache.cache_layout import (
    KVLayoutId,
    bits,
    block_token_views,
    logical_from_pages,
)


def convert_pages(
    src: torch.Tensor,
    src_id: KVLayoutId,
    cache: torch.Tensor,
    dst_id: KVLayoutId,
    ids: list[int] | torch.Tensor,
) -> None:
    """Write pages ``src`` (of layout ``src_id``) into blocks ``ids`` of ``cache`` token by
    token, on the cache's device (the identities must be convertible); ``ids`` may be an
    index already on that device (no upload here)."""
    n = src.shape[0]
    if n == 0:
        return
    logical = logical_from_pages(src.to(cache.device), src_id)
    sk, sv = block_token_views(logical, src_id)
    dk, dv = block_token_views(cache, dst_id)
    shape = (n, dst_id.ratio, dst_id.kernel_block_size, *dk.shape[3:])
    idx = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=cache.device)
    for s, d in ((sk, dk), (sv, dv)):
        if s is None or d is None:
            continue
        tokens = bits(s).reshape(n, src_id.block_size, *s.shape[3:]).reshape(shape)
        bits(d).index_copy_(0, idx, tokens)
