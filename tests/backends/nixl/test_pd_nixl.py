"""Prefill/decode through real vLLM engines over the nixl backend: token equality.

The producer engine stages each request's KV in its NIXL-registered pool; the consumer
engine leases it over the side channel and pulls it with NIXL (UCX) before decoding.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "connector"))

from pd_helpers import (  # noqa: E402
    EngineProc,
    engine_cfg,
    engines,
    kill_group,
    make_prompts,
    omni_ktc,
)

from vllm_omni_kv.testing.net import free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nixl]

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

RECV_TIMEOUT = 15.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
POOL = 64 << 20


@pytest.fixture(scope="module")
def pd(
    tiny_model_dir: Path,
) -> Iterator[
    tuple[
        EngineProc, EngineProc, dict[tuple[int, ...], list[int]], list[list[int]], list[list[int]]
    ]
]:
    equal = make_prompts(tiny_model_dir, 3, seed=31)
    killed = make_prompts(tiny_model_dir, 2, seed=32)
    common = {"host": "127.0.0.1", "memory_pool_size": POOL}
    prod_ktc = omni_ktc(
        "kv_producer",
        backend="nixl",
        backend_extra={**common, "role": "sender", "zmq_port": free_port()},
    )
    cons_ktc = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="nixl",
        recv_timeout=RECV_TIMEOUT,
        backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0},
    )
    with engines(
        ("nixl-producer", engine_cfg(tiny_model_dir, prod_ktc)),
        ("nixl-consumer", engine_cfg(tiny_model_dir, cons_ktc)),
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


def test_nixl_transfer_gives_colocated_tokens(pd: Any) -> None:
    prod, cons, ref, equal, _ = pd
    r = cons.generate(equal, max_tokens=16, kv_transfer_params=_prefill(prod, equal))
    assert "error" not in r, r
    for o, ids in zip(r["outputs"], equal):
        assert o["token_ids"] == ref[tuple(ids)]
        load = o["kv_transfer_params"]["omni_kv_load"]
        # the reference run cached these prompts' blocks on the producer, not the consumer
        assert load["ok"] is True and load["tokens"] == len(ids) and load["bytes"] > 0, load


def test_nixl_killed_producer_recomputes(pd: Any) -> None:
    prod, cons, ref, _, killed = pd
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
