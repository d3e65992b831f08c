"""Prefill/decode over the Mooncake Transfer Engine backend (TCP), when it imports."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import EngineProc, engine_cfg, engines, kill_group, make_prompts, omni_ktc

from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.mooncake]

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine wheel is not installed")
pytest.importorskip("vllm_omni_kv.backends.transfer_engine.mooncake")

# Mooncake's TCP transport occasionally stalls a read (kvcache-ai/Mooncake#4209); the backend
# turns a stall into a ~3 s retry (tcp_progress_timeout_s), so leave room for a few of them.
RECV_TIMEOUT = 15.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
POOL = 64 << 20


@pytest.fixture(scope="module")
def mc(
    tiny_model_dir: Path,
) -> Iterator[
    tuple[
        EngineProc, EngineProc, dict[tuple[int, ...], list[int]], list[list[int]], list[list[int]]
    ]
]:
    equal = make_prompts(tiny_model_dir, 3, seed=21)
    killed = make_prompts(tiny_model_dir, 2, seed=22)
    common = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": POOL}
    prod_ktc = omni_ktc(
        "kv_producer",
        backend="mooncake",
        transfer_format="token_major",  # the shm tests cover the raw-block format
        backend_extra={**common, "role": "sender", "zmq_port": free_port()},
    )
    cons_ktc = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="mooncake",
        recv_timeout=RECV_TIMEOUT,
        backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0},
    )
    with engines(
        ("mc-producer", engine_cfg(tiny_model_dir, prod_ktc)),
        ("mc-consumer", engine_cfg(tiny_model_dir, cons_ktc)),
    ) as (prod, cons):
        # reference: the producer as an ordinary engine (no transfer params)
        out = prod.generate(equal + killed, max_tokens=16)
        ref = {tuple(p): o["token_ids"] for p, o in zip(equal + killed, out["outputs"])}
        yield prod, cons, ref, equal, killed


def _prefill(prod: EngineProc, prompts: list[list[int]]) -> list[dict[str, Any]]:
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
    assert "error" not in r, r
    params = [o["kv_transfer_params"] for o in r["outputs"]]
    assert all(p["remote_port"] > 0 for p in params), params
    return params


def test_mooncake_transfer_gives_colocated_tokens(mc: Any) -> None:
    prod, cons, ref, equal, _ = mc
    r = cons.generate(equal, max_tokens=16, kv_transfer_params=_prefill(prod, equal))
    assert "error" not in r, r
    for o, ids in zip(r["outputs"], equal):
        assert o["token_ids"] == ref[tuple(ids)]
        load = o["kv_transfer_params"]["omni_kv_load"]
        # the reference run cached these prompts' blocks on the producer, not the consumer
        assert load["ok"] is True and load["tokens"] == len(ids) and load["bytes"] > 0, load


def test_mooncake_killed_producer_recomputes(mc: Any) -> None:
    prod, cons, ref, _, killed = mc
    params = _prefill(prod, killed)
    kill_group(prod.proc.pid)
    prod.proc.wait(timeout=30)
    t0 = time.monotonic()
    r = cons.generate(killed, max_tokens=16, kv_transfer_params=params)
    assert time.monotonic() - t0 < RECV_TIMEOUT + 15
    assert "error" not in r, r
    for o, ids in zip(r["outputs"], killed):
        assert o["token_ids"] == ref[tuple(ids)]
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and load["error"], load
