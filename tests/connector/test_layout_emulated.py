"""vLLM 0.32's KV layouts through the connector's worker half, on emulated caches.

Each case builds producer and consumer caches exactly as vLLM does
(``vllm_omni_kv.testing.layout_emulator``, vLLM's own ``create_kv_cache_views``),
stores known per-token K/V the way the attention kernels address them, sends the
request through an :class:`OmniKVWorker` (``wait_for_save``) and loads it through
another (``start_load_kv`` / ``get_transfer_results``), over shared memory and over
the in-process fake backend; the consumer's tokens are read back the kernels' way
and compared with the values written. Runs on any torch device
(``OMNIKV_TEST_DEVICE``, default cpu; ``make gpu-check`` sets cuda).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.metadata import LoadSpec, OmniKVConnectorMetadata, SaveSpec
from vllm_omni_kv.connector.worker import OmniKVWorker
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.testing import fake_backend
from vllm_omni_kv.testing.layout_emulator import (
    ORDERS,
    EmulatedEngine,
    build_caches,
    have_vllm,
    read_tokens,
    reference_tokens,
    write_tokens,
)

DEVICE = os.environ.get("OMNIKV_TEST_DEVICE", "cpu")
SEQ = 100  # 3 full blocks of 32 + 4 tokens
SRC_IDS = [7, 2, 9, 4]
DST_IDS = [1, 5, 0, 8, 3]
DIGEST = "d1"

fake_backend.register_fake_backend()

# every layout vLLM 0.32 hands a connector for the CPU, FlashAttention, FlashInfer and
# Triton backends (FlashInfer's HND, kernel blocks of 16 in 32-token blocks), and MLA
ENGINES: dict[str, EmulatedEngine] = {
    "cpu": EmulatedEngine(backend="CPU_ATTN", layout="LBHNC"),
    **{f"flash-{lay}": EmulatedEngine(backend="FLASH_ATTN", layout=lay) for lay in ORDERS},
    "flash-LBNHC-kernel16": EmulatedEngine(
        backend="FLASH_ATTN", layout="LBNHC", kernel_block_size=16
    ),
    "flashinfer-HND-kernel16": EmulatedEngine(
        backend="FLASHINFER", layout="LBHNC", kernel_block_size=16
    ),
    "triton-LBNHC": EmulatedEngine(backend="TRITON_ATTN", layout="LBNHC"),
    "mla-LBNHC": EmulatedEngine(backend="FLASHMLA", layout="LBNHC", head_size=64),
    "mla-BLHNC": EmulatedEngine(backend="FLASHMLA", layout="BLHNC", head_size=64),
    "mla-LBNHC-kernel16": EmulatedEngine(
        backend="FLASHMLA", layout="LBNHC", head_size=64, kernel_block_size=16
    ),
    # one KV head per rank (GQA at high TP): FlashAttention's NHD pages and FlashInfer's
    # HND pages hold the same bytes
    "flash-LBNHC-1head": EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC", kv_heads=1),
    "flashinfer-HND-1head": EmulatedEngine(backend="FLASHINFER", layout="LBHNC", kv_heads=1),
}
DTYPES = ["bfloat16", "float16", "fp8_e4m3"]
KV_ENGINES = [k for k, e in ENGINES.items() if e.packing != "latent" and e.kv_heads > 1]
ONE_HEAD_ENGINES = [k for k, e in ENGINES.items() if e.packing != "latent" and e.kv_heads == 1]
MLA_ENGINES = [k for k, e in ENGINES.items() if e.packing == "latent"]


def _engine(name: str, dtype: str) -> EmulatedEngine:
    e = ENGINES[name]
    fields = {**e.__dict__, "dtype": dtype, "device": DEVICE}
    return EmulatedEngine(**fields)


def _layout_facts(e: EmulatedEngine) -> EngineLayout:
    """What vLLM's configs tell the connector about this engine."""
    return EngineLayout(
        block_size=e.block_size,
        layout=e.layout,
        backend=e.backend,
        use_mla=e.packing == "latent",
        cache_dtype=e.cache_dtype,
    )


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"lay{uuid.uuid4().hex[:10]}"
    yield name
    fake_backend.clear(name)


def _worker(e: EmulatedEngine, backend: str, ns: str, **extra: Any) -> OmniKVWorker:
    cfg = parse_omni_kv_config(
        {
            "backend": backend,
            "backend_extra": {"namespace": ns},
            "recv_timeout": 10,
            "transfer_cpus": "inherit",
            **extra,
        }
    )
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=e.block_size))
    return OmniKVWorker(vllm_config, cfg, f"engine-{uuid.uuid4().hex[:6]}", engine=_layout_facts(e))


def _transfer(
    src: EmulatedEngine, dst: EmulatedEngine, backend: str, ns: str, *, local: int = 0, **extra: Any
) -> tuple[dict[str, Any], list[Any], dict[str, torch.Tensor], set[int]]:
    """Prefill ``SEQ`` tokens on ``src``, load them into ``dst``; return (load outcome,
    the reference tokens, the consumer's caches, blocks reported invalid)."""
    producer, consumer = _worker(src, backend, ns, **extra), _worker(dst, backend, ns, **extra)
    try:
        pc, cc = build_caches(src), build_caches(dst)
        producer.register_kv_caches(pc)
        consumer.register_kv_caches(cc)
        ref = reference_tokens(src, SEQ, seed=len(ns))
        write_tokens(src, pc, SRC_IDS, ref)
        if local:  # the consumer already holds the first `local` tokens
            write_tokens(
                dst, cc, DST_IDS, [(k[:local], None if v is None else v[:local]) for k, v in ref]
            )
        save = SaveSpec("req", "tid", SRC_IDS, SEQ, DIGEST)
        producer.wait_for_save(OmniKVConnectorMetadata(saves=[save]))
        load = LoadSpec("req", "tid", DST_IDS, local, SEQ - local, SEQ, DIGEST)
        consumer.start_load_kv(OmniKVConnectorMetadata(loads=[load]))
        deadline = time.monotonic() + 20
        done: set[str] = set()
        while "req" not in done and time.monotonic() < deadline:
            done |= consumer.get_transfer_results(set())[1]
            time.sleep(0.002)
        assert "req" in done, "the load did not finish"
        meta = consumer.take_worker_meta()
        assert meta is not None
        invalid = consumer.take_invalid_block_ids()
        producer.get_transfer_results({"req"})
        return meta.loads["req"], ref, cc, invalid
    finally:
        consumer.shutdown()
        producer.shutdown()


def _assert_tokens(dst: EmulatedEngine, caches: dict[str, torch.Tensor], ref: list[Any]) -> None:
    got = read_tokens(dst, caches, DST_IDS, SEQ)
    for layer, ((rk, rv), (gk, gv)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(gk, rk), f"layer {layer}: K differs"
        assert (rv is None) == (gv is None)
        if rv is not None:
            assert torch.equal(gv, rv), f"layer {layer}: V differs"


@pytest.mark.parametrize("backend", ["shm", "fake"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ENGINES))
def test_layout_equal_round_trip(name: str, dtype: str, backend: str, ns: str) -> None:
    e = _engine(name, dtype)
    out, ref, caches, invalid = _transfer(e, e, backend, ns)
    assert out["ok"], out["error"]
    assert out["tokens"] == SEQ and not invalid
    _assert_tokens(e, caches, ref)


def _different_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every ordered pair of different layouts."""
    return [(a, b) for a in names for b in names if a != b]


@pytest.mark.parametrize(
    ("src", "dst"),
    _different_pairs(KV_ENGINES)
    + _different_pairs(ONE_HEAD_ENGINES)
    + _different_pairs(MLA_ENGINES),
)
def test_layout_conversion_round_trip(src: str, dst: str, ns: str) -> None:
    """Different layouts convert on the consumer's device, token for token."""
    s, d = _engine(src, "bfloat16"), _engine(dst, "bfloat16")
    out, ref, caches, invalid = _transfer(s, d, "fake", ns)
    assert out["ok"], out["error"]
    assert not invalid
    _assert_tokens(d, caches, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("src", "dst"), [("cpu", "flash-LBNHC"), ("flash-BHLNC", "flashinfer-HND-kernel16")]
)
def test_layout_conversion_every_dtype_over_shm(src: str, dst: str, dtype: str, ns: str) -> None:
    s, d = _engine(src, dtype), _engine(dst, dtype)
    out, ref, caches, _invalid = _transfer(s, d, "shm", ns)
    assert out["ok"], out["error"]
    _assert_tokens(d, caches, ref)


@pytest.mark.parametrize(("src", "dst"), [("flash-LBNHC", "flash-LBNHC"), ("cpu", "flash-BLNHC")])
def test_layout_tail_only_load_keeps_local_blocks(src: str, dst: str, ns: str) -> None:
    """A local prefix hit of two blocks: only the rest is written (and moved)."""
    s, d = _engine(src, "bfloat16"), _engine(dst, "bfloat16")
    out, ref, caches, _invalid = _transfer(s, d, "fake", ns, local=64)
    assert out["ok"], out["error"]
    assert out["tokens"] == SEQ - 64
    _assert_tokens(d, caches, ref)


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [
        (("flash-LBNHC", "bfloat16"), ("flash-LBNHC", "float16"), "dtype differs"),
        (("cpu", "fp8_e4m3"), ("flash-LBHNC", "bfloat16"), "dtype differs"),
        (("mla-LBNHC", "bfloat16"), ("flash-LBNHC", "bfloat16"), "latent"),
    ],
)
def test_layout_without_lossless_conversion_fails_cleanly(
    src: tuple[str, str], dst: tuple[str, str], why: str, ns: str
) -> None:
    """No byte is written; the load fails naming both identities and vLLM recomputes."""
    s, d = _engine(*src), _engine(*dst)
    out, _ref, caches, invalid = _transfer(s, d, "fake", ns)
    assert not out["ok"]
    assert why in out["error"]
    assert s.backend in out["error"] and d.backend in out["error"]
    assert invalid == set(DST_IDS[:4])  # every block of the request, reported for recompute
    assert all(int(c.view(torch.uint8).count_nonzero()) == 0 for c in caches.values())


def test_layout_different_head_counts_fail_cleanly(ns: str) -> None:
    s = _engine("flash-LBNHC", "bfloat16")
    d = EmulatedEngine(**{**s.__dict__, "kv_heads": 4})
    out, _ref, _caches, _invalid = _transfer(s, d, "fake", ns)
    assert not out["ok"] and "kv_heads differs" in out["error"]


@pytest.mark.parametrize("dst", ["flash-BLHNC", "cpu"])
def test_layout_token_major_transfer_between_layouts(dst: str, ns: str) -> None:
    """The token-major format (used between TP sizes) reads and writes GPU layouts too."""
    s, d = _engine("flash-LBNHC", "bfloat16"), _engine(dst, "bfloat16")
    out, ref, caches, _invalid = _transfer(s, d, "fake", ns, transfer_format="token_major")
    assert out["ok"], out["error"]
    _assert_tokens(d, caches, ref)


def test_default_cuda_layout_registers() -> None:
    """vLLM's default CUDA views (FlashAttention, LBNHC) register, and the connector reads
    the engine's facts rather than the tensor rank (the identity says k_v, not CPU)."""
    e = _engine("flash-LBNHC", "bfloat16")
    w = _worker(e, "fake", "reg")
    try:
        w.register_kv_caches(build_caches(e))
        ident = w.layers[0].ident
        assert (ident.packing, ident.layout, ident.backend) == ("k_v", "LBNHC", "FLASH_ATTN")
    finally:
        w.shutdown()


def test_layout_mismatch_with_the_engine_fails_at_registration() -> None:
    e = _engine("flash-LBNHC", "bfloat16")
    w = _worker(EmulatedEngine(**{**e.__dict__, "layout": "LBHNC"}), "fake", "reg")
    try:
        with pytest.raises(ConfigError, match="not in LBHNC order"):
            w.register_kv_caches(build_caches(e))
    finally:
        w.shutdown()


@pytest.mark.skipif(not have_vllm(), reason="compares against vLLM's own view builder")
@pytest.mark.parametrize("name", list(ENGINES))
def test_emulator_without_vllm_matches_vllm(name: str) -> None:
    """The vLLM-free view builder (used on GPU machines without vLLM) equals vLLM's."""
    e = ENGINES[name]
    ours, theirs = build_caches(e, use_vllm=False), build_caches(e, use_vllm=True)
    for a, b in zip(ours.values(), theirs.values(), strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.dtype,
        )


def test_layout_without_token_views_refuses_token_major_at_registration() -> None:
    e = _engine("mla-LBNHC", "bfloat16")
    w = _worker(e, "fake", "reg", transfer_format="token_major")
    try:
        with pytest.raises(ConfigError, match="no per-token K/V view"):
            w.register_kv_caches(build_caches(e))
    finally:
        w.shutdown()
