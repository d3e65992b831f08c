"""Prefill/decode between engines of different tensor-parallel sizes (real vLLM, CPU, shm).

Two ``kv_both`` engines, one of TP 2 and one of TP 1, each producer for the other:
TP 2 -> TP 1 and TP 1 -> TP 2 run between the same two engines (``kv_both`` does both
roles in one engine). The producer and consumer shard the KV heads differently, so the
connector sends token-major K/V per target rank (the producer slices or the consumer
merges head shards). Greedy tokens must equal the producer's own answer (no transfer
parameters; TP 1 and TP 2 give the same greedy tokens here, so each direction checks a
TP-2 engine against a TP-1 one), with every request's KV really loaded. CPU TP needs
one core per rank: ``VLLM_CPU_OMP_THREADS_BIND`` pins rank 0 to core 0 and rank 1 to
core 1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import engine_cfg, engines, make_prompts, omni_ktc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
SHM = "/dev/shm"
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}

if (os.cpu_count() or 1) < 2:
    pytest.skip("tensor parallelism on CPU needs two cores", allow_module_level=True)


def _cfg(model: Path, tp: int, ktc: dict | None = None) -> dict:
    cfg = engine_cfg(model, ktc, tensor_parallel_size=tp)
    if tp > 1:
        cfg["env"] = TP2_ENV
    return cfg


@pytest.fixture(scope="module")
def both(tiny_model_dir: Path) -> Iterator[dict[int, Any]]:
    """A TP-2 and a TP-1 ``kv_both`` engine, each configured for the other's TP size."""

    def ktc(target_tp: int) -> dict[str, Any]:
        return omni_ktc("kv_both", "fail", backend="shm", target_tp_size=target_tp, recv_timeout=60)

    before = _vllm_tp_segments()
    try:
        with engines(
            ("tp2-both", _cfg(tiny_model_dir, 2, ktc(1))),
            ("tp1-both", _cfg(tiny_model_dir, 1, ktc(2))),
        ) as (tp2, tp1):
            yield {2: tp2, 1: tp1}
    finally:
        # vLLM's TP-2 workers can leave their communicator's segments behind when they are
        # stopped (2 of 3 runs here): the ones created while this module's engines ran go
        for name in _vllm_tp_segments() - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))


def _vllm_tp_segments() -> set[str]:
    """vLLM's CPU tensor-parallel shared-memory segments (``vllm_dist_*``); only this
    module's engines run with TP > 1."""
    return {n for n in os.listdir(SHM) if n.startswith("vllm_dist_")}


@pytest.mark.parametrize(("prod_tp", "cons_tp"), [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_heterogeneous_tp_matches_colocated(
    tiny_model_dir: Path, both: dict[int, Any], prod_tp: int, cons_tp: int
) -> None:
    prod, cons = both[prod_tp], both[cons_tp]
    prompts = make_prompts(tiny_model_dir, 3, seed=7 + prod_tp)
    r = prod.generate(prompts, max_tokens=12)  # the reference: no transfer parameters
    assert "error" not in r, r
    want = [o["token_ids"] for o in r["outputs"]]
    pre = prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
    assert "error" not in pre, pre
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p.get("tp_size") == prod_tp for p in params), params
    got = cons.generate(prompts, max_tokens=12, kv_transfer_params=params)
    assert "error" not in got, got
    assert [o["token_ids"] for o in got["outputs"]] == want
    loads = [o["kv_transfer_params"]["omni_kv_load"] for o in got["outputs"]]
    assert all(x["ok"] for x in loads), loads
    assert all(x["bytes"] > 0 for x in loads), loads
    assert all(x["tokens"] == len(p) for x, p in zip(loads, prompts, strict=True)), loads
