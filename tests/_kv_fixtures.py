"""Deterministic paged KV caches and independent reference extraction for tests."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

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


class GuardedLayers:
    """Consumer layers in vLLM's CPU layout (``[nblocks, heads, bs, 2*dim]``, bf16) as views
    into one buffer with ``guard`` bytes of a known pattern before, between and after them:
    what a load wrote is found by comparing with the buffer as it was."""

    def __init__(
        self, layers: int, nblocks: int, heads: int, bs: int, dim: int, guard: int = 4096
    ) -> None:
        self.num_layers, self.nblocks, self.guard = layers, nblocks, guard
        self.layer_bytes = nblocks * heads * bs * 2 * dim * 2
        self.page = self.layer_bytes // nblocks
        step = self.layer_bytes + guard
        self.buf = torch.full((guard + layers * step,), 0x5A, dtype=torch.uint8)
        self.caches = [
            self.buf[guard + i * step :][: self.layer_bytes]
            .view(torch.bfloat16)
            .view(nblocks, heads, bs, 2 * dim)
            for i in range(layers)
        ]
        self.before = self.buf.clone()

    def spoiled_guards(self) -> list[int]:
        """Indices of the guard areas that changed."""
        step = self.layer_bytes + self.guard
        return [
            i
            for i in range(self.num_layers + 1)
            if not torch.equal(
                self.buf[i * step : i * step + self.guard],
                self.before[i * step : i * step + self.guard],
            )
        ]

    def changed_pages(self) -> dict[tuple[int, int], torch.Tensor]:
        """``(layer, block) -> page bytes`` of every page that changed."""
        out = {}
        for i in range(self.num_layers):
            base = self.guard + i * (self.layer_bytes + self.guard)
            for b in range(self.nblocks):
                s = base + b * self.page
                if not torch.equal(self.buf[s : s + self.page], self.before[s : s + self.page]):
                    out[(i, b)] = self.buf[s : s + self.page].clone()
        return out


def load_and_wait(consumer: Any, load: Any, timeout: float = 20.0) -> Any:
    """Start ``load`` on a connector worker half, wait until vLLM would see it finished,
    and return the worker's metadata of the step (``AssertionError`` on a timeout)."""
    from vllm_omni_kv.connector.metadata import OmniKVConnectorMetadata

    consumer.start_load_kv(OmniKVConnectorMetadata(loads=[load]))
    deadline, done = time.monotonic() + timeout, set()
    while load.req_id not in done and time.monotonic() < deadline:
        done |= consumer.get_transfer_results(set())[1]
        time.sleep(0.002)
    assert load.req_id in done, "the load did not finish"
    return consumer.take_worker_meta()


@contextlib.contextmanager
def shm_namespace(prefix: str, strict: bool = True) -> Iterator[str]:
    """A fresh shared-memory namespace; on exit, every file left in it is removed and,
    when ``strict``, the test fails naming them."""
    from vllm_omni_kv.backends.shm import arena

    ns = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield ns
    left = arena.namespace_files(ns)
    for n in left:
        arena.unlink_quiet(n)
    assert not (strict and left), f"left in /dev/shm: {sorted(left)}"


class ShmRegions:
    """A producer's shared-memory cache region in namespace ``ns`` holding ``nbytes`` of
    random bytes (``seed``), and a consumer's region that reads producers' regions."""

    def __init__(self, ns: str, nbytes: int, seed: int) -> None:
        from vllm_omni_kv.backends.shm import arena
        from vllm_omni_kv.backends.shm.cache_region import ShmCacheRegion
        from vllm_omni_kv.backends.shm.producer import ProducerArena

        self.arena = ProducerArena(0, namespace=ns)
        self.region = ShmCacheRegion(ns, self.arena, arena.STALE_S)
        self.reader_arena = ProducerArena(0, namespace=ns)
        self.reader = ShmCacheRegion(ns, self.reader_arena, arena.STALE_S)
        flat = self.region.allocate(nbytes + (1 << 20))
        assert flat is not None, self.region.unavailable_reason
        g = torch.Generator().manual_seed(seed)
        #: the producer's cache bytes, the start of the region's allocation
        self.cache = flat[:nbytes].view(torch.uint8)
        self.cache.copy_(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8))

    def close(self) -> None:
        self.reader.close()
        self.region.close()
        self.reader_arena.close()
        self.arena.close()


def lbnhc_views(
    buf: torch.Tensor, layers: int, blocks: int, heads: int, bs: int, dim: int
) -> list[torch.Tensor]:
    """vLLM's per-layer fp32 ``[blocks, heads, bs, 2*dim]`` views of one flat ``int8``
    allocation (token-major inside a block, K|V per token), layer after layer."""
    per = blocks * heads * bs * 2 * dim * 4
    return [
        buf[i * per : (i + 1) * per]
        .view(torch.float32)
        .view(blocks, bs, heads, 2 * dim)
        .transpose(1, 2)
        for i in range(layers)
    ]
