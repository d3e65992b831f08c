"""Prefill/decode with real engines in each one-copy mode that runs on this machine.

``shm`` with ``share_cache`` (the producer's KV cache in a shared-memory file) and
``mooncake`` with ``register_cache`` (registered with the transfer engine, TCP on
127.0.0.1): vLLM allocates the producer's cache inside the connector's
``get_mem_pool_context()``, a payload is a small frame of block ids, and the consumer
copies just the pages it lacks straight out of the producer's cache into its own.
Tokens must equal the producer's own run of the same prompts (an ordinary engine for
requests without transfer parameters); the producer keeps the blocks until they are
copied (or their lease runs out) and gives them back afterwards. The producer runs with
a 65-block cache, so a request needing every block shows whether any is still held.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    NAMESPACE,
    SMALL_CACHE_BLOCKS,
    EngineProc,
    assert_cache_free,
    engine_cfg,
    engines,
    kill_group,
    make_prompts,
    omni_ktc,
    sweep_dead_segments,
    whole_cache_prompt,
)

from vllm_omni_kv.backends.shm.inventory import ShmInventory, inventory
from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEND_TTL = 8.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
# tiny model: 2 layers, 2 KV heads, head size 64, fp32: bytes of one 32-token block, all layers
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 32
_TE = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 16 << 20}
#: mode -> (backend, producer backend_extra, consumer backend_extra, recv_timeout)
MODES: dict[str, tuple[str, Any, dict[str, Any], float]] = {
    "shm": ("shm", lambda: {"share_cache": True}, {"share_cache": True}, 4.0),
    "mooncake": (
        "mooncake",
        lambda: {**_TE, "role": "sender", "zmq_port": free_port(), "register_cache": True},
        {**_TE, "role": "receiver", "side_channel_timeout_s": 1.0, "register_cache": True},
        15.0,  # room for a Mooncake TCP stall turned into a ~3 s retry
    ),
}
_MC = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="no mooncake")


class PD:
    def __init__(self, mode: str, prod: EngineProc, cons: EngineProc) -> None:
        self.mode, self.prod, self.cons = mode, prod, cons
        self.recv_timeout = MODES[mode][3]
        self.ref: dict[tuple[int, ...], list[int]] = {}

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


def _shm() -> ShmInventory:
    """What this run's shared-memory namespace holds (holds, caches, payload segments)."""
    return inventory(NAMESPACE)


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {
        "equal": make_prompts(tiny_model_dir, 4, seed=10),
        "held": make_prompts(tiny_model_dir, 1, seed=11),
        "killed": make_prompts(tiny_model_dir, 2, seed=12),
        "slept": make_prompts(tiny_model_dir, 3, seed=13),
    }


@pytest.fixture(scope="module", params=["shm", pytest.param("mooncake", marks=[_MC])])
def pd(
    request: pytest.FixtureRequest, tiny_model_dir: Path, groups: dict[str, list[list[int]]]
) -> Iterator[PD]:
    mode = request.param
    backend, prod_extra, cons_extra, recv_timeout = MODES[mode]
    prod_ktc = omni_ktc(
        "kv_producer", backend=backend, backend_extra=prod_extra(), send_ttl=SEND_TTL
    )
    cons_ktc = omni_ktc(
        "kv_consumer", "recompute", backend=backend, backend_extra=cons_extra,
        recv_timeout=recv_timeout,
    )  # fmt: skip
    small = {"num_gpu_blocks_override": SMALL_CACHE_BLOCKS}
    with engines(
        (f"onecopy-{mode}-producer", engine_cfg(tiny_model_dir, prod_ktc, **small)),
        (f"onecopy-{mode}-consumer", engine_cfg(tiny_model_dir, cons_ktc)),
    ) as (prod, cons):
        pd = PD(mode, prod, cons)
        for prompts in groups.values():  # reference: the producer as an ordinary engine
            out = prod.generate(prompts, max_tokens=16)
            assert "error" not in out, out
            pd.ref.update({tuple(p): o["token_ids"] for p, o in zip(prompts, out["outputs"])})
        yield pd


def test_pages_are_copied_once_from_the_producers_cache(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["equal"]
    params = pd.prefill(prompts)
    if pd.mode == "shm":  # block ids, not bytes: no payload segment, a hold per request,
        inv = _shm()
        assert inv.holds == len(prompts), inv
        assert inv.segments == 0, inv
        assert inv.caches == 1, inv  # the producer's cache; a consumer exports none
    loads = pd.decode(prompts, params)
    for load, ids in zip(loads, prompts):
        assert load["ok"] is True and load["tokens"] == len(ids), load
        # the request's pages, plus a descriptor frame of about a kilobyte (no packed KV)
        pages = -(-len(ids) // 32) * BLOCK_BYTES
        assert pages < load["bytes"] < pages + 4096, load
    assert _shm().holds == 0  # released by the consumer after its copy
    assert_cache_free(pd.prod, tiny_model_dir, timeout=SEND_TTL / 2)  # blocks given back


def test_local_prefix_hit_copies_only_the_last_block(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["equal"]  # cached by the consumer in the previous test
    loads = pd.decode(prompts, pd.prefill(prompts))
    for load, ids in zip(loads, prompts):  # vLLM's local hit: every full block but the last
        assert load["ok"] is True and not load.get("local_hit"), load
        assert load["tokens"] == len(ids) - (len(ids) - 1) // 32 * 32, load
        assert BLOCK_BYTES <= load["bytes"] < BLOCK_BYTES + 4096, load
    deadline = time.monotonic() + 5
    while _shm().holds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shm().holds == 0
    assert_cache_free(pd.prod, tiny_model_dir, timeout=SEND_TTL / 2)


def test_blocks_stay_held_until_the_lease_runs_out_then_the_consumer_recomputes(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    prompts = groups["held"]
    t0 = time.monotonic()
    params = pd.prefill(prompts)
    # nobody reads the payload: a request needing every block of the producer's cache
    # waits until the producer takes its blocks back, after send_ttl
    r = pd.prod.generate([whole_cache_prompt(tiny_model_dir)], max_tokens=4, timeout=120)
    assert "error" not in r, r
    waited = time.monotonic() - t0
    assert waited >= SEND_TTL - 1, f"the held blocks were reused after {waited:.1f}s"
    assert _shm().holds == 0
    # a consumer that comes late finds nothing and recomputes the same tokens
    loads = pd.decode(prompts, params)
    assert loads[0]["ok"] is False, loads


def test_sleep_and_wake_mid_traffic_recompute_then_transfer_again(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    """vLLM 0.33's sleep mode, as the connector sees it (``EngineProc.sleep``: its
    unregister and restore hooks, the cache overwritten in between)."""
    a, b, c = groups["slept"]
    # the producer sleeps with a's payload published: voided, the consumer recomputes a
    params_a = pd.prefill([a])
    slept = pd.prod.sleep()
    assert slept["unregister_s"] < 5 and slept["prefix_cache_reset"] is True, slept
    assert _shm().holds == 0  # no hold left on the slept cache's blocks
    if pd.mode == "shm":  # (Mooncake: a consumer would wait recv_timeout, 15 s, for it;
        # test_te_cache_region shows that payload gone after the producer's sleep)
        (load,) = pd.decode([a], params_a)  # tokens equal the colocated run's
        assert load["ok"] is False, load
    # the consumer sleeps while b's load waits for a payload: it fails, b recomputes
    params_b = pd.prefill([b])
    waiting = {**params_b[0], "remote_request_id": "never-published"}
    got = pd.cons.sleep(b, waiting)
    assert got["unregister_s"] < pd.recv_timeout / 2, got  # the load stopped at once
    assert got["prefix_cache_reset"] is True, got
    assert got["token_ids"] == pd.ref[tuple(b)], "recomputed tokens differ from colocated"
    assert got["kv_transfer_params"]["omni_kv_load"]["ok"] is False, got
    (load,) = pd.decode([b], params_b)  # b's own payload, still held: copied exactly
    assert load["ok"] is True and load["tokens"] == len(b), load
    # both woke: c moves exactly, out of the cache's new generation
    (load,) = pd.decode([c], pd.prefill([c]))
    assert load["ok"] is True and load["tokens"] == len(c), load
    assert _shm().holds == 0
    assert_cache_free(pd.prod, tiny_model_dir, timeout=SEND_TTL / 2)


def test_killed_producer_recomputes_and_leaves_nothing(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    # Runs last: the producer is gone afterwards, its cache file and holds are swept.
    prompts = groups["killed"]
    params = pd.prefill(prompts)
    kill_group(pd.prod.proc.pid)
    pd.prod.proc.wait(timeout=30)
    deadline = time.monotonic() + 30  # its worker process may outlive the main one briefly
    while (inv := _shm()).orphans < inv.files and time.monotonic() < deadline:
        time.sleep(0.1)  # until every file of the namespace (the producer's) is an orphan
    sweep_dead_segments()
    t0 = time.monotonic()
    loads = pd.decode(prompts, params)
    assert time.monotonic() - t0 < pd.recv_timeout + 15
    assert all(x["ok"] is False and x["error"] for x in loads), loads
    inv = _shm()
    assert inv.holds == 0, inv
    if pd.mode == "shm":
        assert inv.caches == 0, inv  # the producer's cache is swept; the consumer exports none
