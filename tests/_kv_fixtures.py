"""Deterministic paged KV caches and independent reference extraction for tests."""

from __future__ import annotations

import torch

LAYERS, HEADS, BS, DIM, NBLOCKS = 3, 4, 32, 64, 12


def cpu_layout_cache(
    layer: int, heads: int = HEADS, seed: int = 0, dtype=torch.bfloat16, nblocks: int = NBLOCKS
) -> torch.Tensor:
    """A vLLM 0.32 CPU-backend cache: [num_blocks, heads, block_size, 2*head_dim]."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randn(nblocks, heads, BS, 2 * DIM, generator=g).to(dtype)


def reference_kv(
    cache: torch.Tensor, block_ids: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token extraction with explicit loops (independent of the code under test)."""
    nb, heads, bs, two_d = cache.shape
    d = two_d // 2
    # per (block, head): K stored transposed as [d, bs], then V as [bs, d]
    k_part = cache.view(nb, heads, 2, d * bs)[:, :, 0].reshape(nb, heads, d, bs)
    v_part = cache.view(nb, heads, 2, bs * d)[:, :, 1].reshape(nb, heads, bs, d)
    k = torch.empty(seq_len, heads, d, dtype=cache.dtype)
    v = torch.empty(seq_len, heads, d, dtype=cache.dtype)
    for t in range(seq_len):
        b, off = block_ids[t // bs], t % bs
        for h in range(heads):
            k[t, h] = k_part[b, h, :, off]
            v[t, h] = v_part[b, h, off]
    return k, v


def head_shard(cache: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The heads a TP rank holds, as its own contiguous cache."""
    heads = cache.shape[1]
    per = heads // tp
    return cache[:, rank * per : (rank + 1) * per].contiguous()
