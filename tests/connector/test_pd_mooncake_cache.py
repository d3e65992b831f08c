"""Prefill/decode over Mooncake TE with the producer's KV cache registered (``register_cache``).

The producer's vLLM allocates its KV cache inside the connector's
``get_mem_pool_context()``, which registers it with the transfer engine; a payload is a
small frame of block ids, and the consumer pulls just the pages it lacks straight out
of the producer's cache into its own (TCP on 127.0.0.1). Tokens must equal the
producer's own (colocated) run; the producer keeps the blocks until they are pulled
(or their lease runs out) and gives them back afterwards. The producer runs with a
65-block cache, so a request needing every block shows whether any is still held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    SMALL_CACHE_BLOCKS,
    EngineProc,
    assert_cache_free,
    engine_cfg,
    engines,
    kill_group,
    make_prompts,
    omni_ktc,
    whole_cache_prompt,
)

from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.mooncake]

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine wheel is not installed")

RECV_TIMEOUT = 15.0  # room for a Mooncake TCP stall turned into a ~3 s retry
SEND_TTL = 8.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
# tiny model: 2 layers, 2 KV heads, head size 64, fp32: bytes of one 32-token block, all layers
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 32
COMMON = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 16 << 20}


class PD:
    def __init__(self, prod: EngineProc, cons: EngineProc, ref: dict[tuple[int, ...], list[int]]):
        self.prod, self.cons, self.ref = prod, cons, ref

    def prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        r = self.prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
        assert "error" not in r, r
        return [o["kv_transfer_params"] for o in r["outputs"]]

    def decode(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict]:
        r = self.cons.generate(prompts, max_tokens=16, kv_transfer_params=[*params])
        assert "error" not in r, r
        for o, ids in zip(r["outputs"], prompts):
            assert o["token_ids"] == self.ref[tuple(ids)], "consumer tokens differ from colocated"
        return [o["kv_transfer_params"]["omni_kv_load"] for o in r["outputs"]]


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {
        "equal": make_prompts(tiny_model_dir, 4, seed=30),
        "held": make_prompts(tiny_model_dir, 1, seed=31),
        "killed": make_prompts(tiny_model_dir, 2, seed=32),
    }


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, groups: dict[str, list[list[int]]]) -> Iterator[PD]:
    prod_ktc = omni_ktc(
        "kv_producer",
        backend="mooncake",
        send_ttl=SEND_TTL,
        backend_extra={**COMMON, "role": "sender", "zmq_port": free_port(), "register_cache": True},
    )
    cons_ktc = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="mooncake",
        recv_timeout=RECV_TIMEOUT,
        backend_extra={
            **COMMON,
            "role": "receiver",
            "side_channel_timeout_s": 1.0,
            "register_cache": True,
        },
    )
    small = {"num_gpu_blocks_override": SMALL_CACHE_BLOCKS}
    with engines(
        ("mccache-producer", engine_cfg(tiny_model_dir, prod_ktc, **small)),
        ("mccache-consumer", engine_cfg(tiny_model_dir, cons_ktc)),
    ) as (prod, cons):
        # reference: the producer as an ordinary (colocated) engine, one group at a time
        ref: dict[tuple[int, ...], list[int]] = {}
        for prompts in groups.values():
            out = prod.generate(prompts, max_tokens=16)
            assert "error" not in out, out
            ref.update({tuple(p): o["token_ids"] for p, o in zip(prompts, out["outputs"])})
        yield PD(prod, cons, ref)


def test_pages_are_pulled_once_from_the_producers_cache(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["equal"]
    t0 = time.monotonic()
    loads = pd.decode(prompts, pd.prefill(prompts))
    dt = time.monotonic() - t0
    for load, ids in zip(loads, prompts):
        assert load["ok"] is True and load["tokens"] == len(ids), load
        # the request's pages, plus a descriptor frame of about a kilobyte (no packed KV)
        pages = -(-len(ids) // 32) * BLOCK_BYTES
        assert pages < load["bytes"] < pages + 4096, load
    print(f"loads {[x['bytes'] for x in loads]} bytes, prefill+decode {dt:.2f}s")
    assert_cache_free(pd.prod, tiny_model_dir, timeout=SEND_TTL / 2)  # blocks given back


def test_local_prefix_hit_releases_the_blocks_at_once(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["equal"]  # cached by the consumer in the previous test
    loads = pd.decode(prompts, pd.prefill(prompts))
    assert all(x["ok"] and x.get("local_hit") for x in loads), loads
    assert_cache_free(pd.prod, tiny_model_dir, timeout=SEND_TTL / 2)


def test_blocks_stay_held_until_the_lease_runs_out_then_the_consumer_recomputes(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["held"]
    t0 = time.monotonic()
    params = pd.prefill(prompts)
    # nobody pulls the payload: a request needing every block of the producer's cache
    # waits until the producer takes its blocks back, after send_ttl
    r = pd.prod.generate([whole_cache_prompt(tiny_model_dir)], max_tokens=4, timeout=120)
    assert "error" not in r, r
    waited = time.monotonic() - t0
    assert waited >= SEND_TTL - 1, f"the held blocks were reused after {waited:.1f}s"
    # a consumer that comes late finds nothing and recomputes the same tokens
    loads = pd.decode(prompts, params)
    assert loads[0]["ok"] is False, loads


def test_killed_producer_recomputes(pd: PD, groups: dict[str, list[list[int]]]) -> None:
    # Runs last: the producer is gone afterwards.
    prompts = groups["killed"]
    params = pd.prefill(prompts)
    kill_group(pd.prod.proc.pid)
    pd.prod.proc.wait(timeout=30)
    t0 = time.monotonic()
    loads = pd.decode(prompts, params)
    assert time.monotonic() - t0 < RECV_TIMEOUT + 15
    assert all(x["ok"] is False and x["error"] for x in loads), loads
