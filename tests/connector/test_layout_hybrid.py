"""A hybrid model's cache (a sliding-window group and a full-attention group, as vLLM's
hybrid KV cache manager lays them out) through the worker halves, on emulated caches
of several attention backends (``vllm_omni_kv.testing.layout_emulator``).

The references: the tokens written the kernels' way, and vLLM's sliding-window rule:
after ``n`` tokens a window of ``w`` keeps blocks from ``(n - w + 1) // block_size``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _kv_fixtures import load_and_wait

from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.metadata import LoadSpec, OmniKVConnectorMetadata, SaveSpec
from vllm_omni_kv.connector.worker import OmniKVWorker
from vllm_omni_kv.testing import fake_backend
from vllm_omni_kv.testing.layout_emulator import (
    EmulatedEngine,
    build_caches,
    kv_cache_config,
    read_tokens,
    reference_tokens,
    write_tokens,
)

DEVICE = os.environ.get("OMNIKV_TEST_DEVICE", "cpu")
SEQ, WINDOW, BS = 150, 64, 32  # 5 blocks; the window keeps blocks 2..4
KEPT = (SEQ - WINDOW + 1) // BS
# the producer's tables at save time: the sliding group still holds every block
SRC = [[5, 7, 9, 2, 4], [1, 3, 6, 8, 10]]
SAVE = [[0] * KEPT + SRC[0][KEPT:], SRC[1]]  # what the scheduler names: the window only
DST = [[0, 0, 11, 5, 7], [1, 2, 3, 4, 6]]  # vLLM's consumer tables: nulls before the window
DIGEST = "d1"

fake_backend.register_fake_backend()

ENGINES = {
    "cpu": EmulatedEngine(backend="CPU_ATTN", layout="LBHNC"),
    "flash-LBNHC": EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC"),
    "flash-BLNHC": EmulatedEngine(backend="FLASH_ATTN", layout="BLNHC"),
    "flashinfer-HND-kernel16": EmulatedEngine(
        backend="FLASHINFER", layout="LBHNC", kernel_block_size=16
    ),
}


def _engine(name: str) -> EmulatedEngine:
    fields = {**ENGINES[name].__dict__, "device": DEVICE, "num_layers": 4, "num_blocks": 12}
    return EmulatedEngine(**{**fields, "sliding_window": WINDOW})


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"hyb{uuid.uuid4().hex[:10]}"
    yield name
    fake_backend.clear(name)


def _worker(e: EmulatedEngine, backend: str, ns: str) -> OmniKVWorker:
    cfg = parse_omni_kv_config(
        {
            "backend": backend,
            "backend_extra": {"namespace": ns},
            "recv_timeout": 10,
            "transfer_cpus": "inherit",
        }  # fmt: skip
    )
    facts = EngineLayout(block_size=e.block_size, layout=e.layout, backend=e.backend)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=e.block_size))
    return OmniKVWorker(
        vllm_config,
        cfg,
        f"engine-{uuid.uuid4().hex[:6]}",
        kv_cache_config=kv_cache_config(e),
        engine=facts,
    )


def _transfer(
    src: EmulatedEngine, dst: EmulatedEngine, backend: str, ns: str, local: int = 0
) -> tuple[dict[str, Any], list[Any], dict[str, torch.Tensor]]:
    """Prefill ``SEQ`` tokens on ``src``, load them into ``dst`` past ``local`` tokens."""
    producer, consumer = _worker(src, backend, ns), _worker(dst, backend, ns)
    try:
        pc, cc = build_caches(src), build_caches(dst)
        producer.register_kv_caches(pc)
        consumer.register_kv_caches(cc)
        ref = reference_tokens(src, SEQ, seed=len(ns))
        write_tokens(src, pc, SRC, ref)
        save = SaveSpec("req", "tid", SAVE[0], SEQ, DIGEST, group_block_ids=SAVE)
        producer.wait_for_save(OmniKVConnectorMetadata(saves=[save]))
        load = LoadSpec("req", "tid", DST[0], local, SEQ - local, SEQ, DIGEST, group_block_ids=DST)
        meta = load_and_wait(consumer, load)
        assert meta is not None and not consumer.take_invalid_block_ids()
        producer.get_transfer_results({"req"})
        return meta.loads["req"], ref, cc
    finally:
        consumer.shutdown()
        producer.shutdown()


def _page_bytes(e: EmulatedEngine) -> int:
    return e.heads * e.block_size * e.content_bytes


def _check(
    dst: EmulatedEngine, caches: dict[str, torch.Tensor], ref: list[Any], start: int
) -> None:
    """Full layers hold tokens ``[start, SEQ)``, sliding layers those of their window
    (from ``start`` on); no block outside the consumer's tables was written."""
    got = read_tokens(dst, caches, DST, SEQ)
    for layer, ((rk, rv), (gk, gv)) in enumerate(zip(ref, got, strict=True)):
        first = start if dst.group_of(layer) == 1 else max(start, KEPT * BS)
        assert torch.equal(gk[first:], rk[first:]), f"layer {layer}: K differs"
        assert rv is not None and gv is not None and torch.equal(gv[first:], rv[first:])
    used = {b for table in DST for b in table if b}
    r = dst.block_size // dst.kernel  # kernel blocks per block
    for view in caches.values():
        for b in set(range(dst.num_blocks)) - used:
            page = view[b * r : (b + 1) * r].view(torch.uint8)
            assert int(page.count_nonzero()) == 0, f"block {b} written"


@pytest.mark.parametrize("backend", ["shm", "fake"])
@pytest.mark.parametrize("name", list(ENGINES))
def test_hybrid_round_trip_moves_each_group_its_blocks(name: str, backend: str, ns: str) -> None:
    e = _engine(name)
    out, ref, caches = _transfer(e, e, backend, ns)
    assert out["ok"], out["error"]
    assert out["tokens"] == SEQ
    _check(e, caches, ref, 0)
    if backend == "shm":  # whole pages plus the frame's metadata: 2 * 5 + 2 * 3 pages
        assert out["bytes"] // _page_bytes(e) == 2 * 5 + 2 * (5 - KEPT)


@pytest.mark.parametrize(("src", "dst"), [("cpu", "flash-LBNHC"), ("flash-BLNHC", "cpu")])
def test_hybrid_conversion_and_local_prefix(src: str, dst: str, ns: str) -> None:
    """Layouts convert per group; a local prefix of 3 blocks leaves one block per layer."""
    s, d = _engine(src), _engine(dst)
    out, ref, caches = _transfer(s, d, "shm", ns, local=96)
    assert out["ok"], out["error"]
    assert out["tokens"] == SEQ - 96
    _check(d, caches, ref, 96)
