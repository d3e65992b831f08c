"""Payload leases and dead readers with real vLLM engines over shared memory.

A producer and a consumer engine (``send_ttl`` of a few seconds) and a plain
consumer process that is SIGKILLed after claiming a payload. Greedy tokens must equal
a colocated engine's in every case, and afterwards nothing is left: no index entry,
every arena segment back in the producer's pool (FREE), every KV block of both
engines free.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    NAMESPACE,
    SMALL_CACHE_BLOCKS,
    EngineProc,
    assert_cache_free,
    colocated_reference,
    engine_cfg,
    engines,
    long_prompt,
    make_prompts,
    omni_ktc,
    omnikv_files,
    whole_cache_prompt,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CTX = mp.get_context("spawn")
#: long enough for a request to reach the consumer on a loaded 2-core machine
SEND_TTL = 4.0
STALE = 3.0  # heartbeat_stale_s: a dead reader's segment comes back after this
WAIT = 90.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
#: tokens the consumer generates while a second request waits for its blocks
QUEUE_TOKENS = 960


def _until(cond: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _index_entries() -> set[str]:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    return {n for n in omnikv_files() if n.startswith(shm_arena.IDX_PREFIX)}


def _segment_states() -> dict[str, int]:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    out = {}
    for n in omnikv_files():
        if n.startswith(shm_arena.SEG_PREFIX):
            words = shm_arena.read_header(n)
            out[n] = -1 if words is None else words[0]
    return out


def _all_free() -> bool:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    return not _index_entries() and all(s == shm_arena.FREE for s in _segment_states().values())


class PD:
    def __init__(self, prod: EngineProc, cons: EngineProc, ref: dict[tuple[int, ...], list[int]]):
        self.prod, self.cons, self.ref = prod, cons, ref

    def prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        r = self.prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
        assert "error" not in r, r
        return [o["kv_transfer_params"] for o in r["outputs"]]

    def decode(
        self, prompts: list[list[int]], params: list[dict[str, Any] | None], max_tokens: int = 16
    ) -> list[dict[str, Any]]:
        r = self.cons.generate(prompts, max_tokens=max_tokens, kv_transfer_params=params)
        assert "error" not in r, r
        loads = []
        for o, ids, p in zip(r["outputs"], prompts, params, strict=True):
            assert o["token_ids"] == self.ref[tuple(ids)][:max_tokens], "tokens differ"
            loads.append((o.get("kv_transfer_params") or {}).get("omni_kv_load") if p else None)
        return loads


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {
        "idle": make_prompts(tiny_model_dir, 1, seed=11),
        "killed": make_prompts(tiny_model_dir, 1, seed=12),
        "after": make_prompts(tiny_model_dir, 2, seed=13),
        # more blocks (32) than the filler leaves free while it runs (30 of SMALL_CACHE_BLOCKS)
        "queued": [long_prompt(tiny_model_dir, 1000, seed=14)],
        "filler": [whole_cache_prompt(tiny_model_dir, QUEUE_TOKENS)],
    }


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, groups: dict[str, list[list[int]]]) -> Iterator[PD]:
    every = [p for g in groups.values() for p in g]
    ref = colocated_reference(tiny_model_dir, every, max_tokens=QUEUE_TOKENS, name="lease-colo")
    extra = {"backend_extra": {"heartbeat_stale_s": STALE}, "send_ttl": SEND_TTL}
    prod_ktc = omni_ktc("kv_producer", backend="shm", **extra)
    cons_ktc = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=4.0, **extra)
    small = {"num_gpu_blocks_override": SMALL_CACHE_BLOCKS}
    with engines(
        ("lease-producer", engine_cfg(tiny_model_dir, prod_ktc, **small)),
        ("lease-consumer", engine_cfg(tiny_model_dir, cons_ktc, **small)),
    ) as (prod, cons):
        yield PD(prod, cons, ref)


def test_idle_producer_frees_an_unconsumed_payload_and_the_consumer_recomputes(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    prompts = groups["idle"]
    params = pd.prefill(prompts)
    assert _index_entries()  # published
    # no further request reaches the producer: only its lease timer can withdraw it
    assert _until(_all_free), f"left: {_index_entries()} {_segment_states()}"
    (load,) = pd.decode(prompts, list(params))
    assert load is not None and load["ok"] is False and "no KV payload" in load["error"], load


def test_a_request_waiting_for_blocks_extends_its_payload_beyond_send_ttl(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    # The filler holds 34 of the consumer's 64 blocks, first while it waits recv_timeout
    # (4 s) for a payload that never comes, then while it recomputes and decodes
    # QUEUE_TOKENS tokens; the remote request needs 32 blocks, so it waits for all of that
    # (at least recv_timeout plus 960 decode steps, whatever the machine's speed), and
    # its scheduler extends the payload's lease meanwhile.
    from vllm_omni_kv.backends.shm import arena as shm_arena

    queued = groups["queued"]
    params = pd.prefill(queued)
    sent = time.monotonic()
    (idx,) = _index_entries()
    seen: dict[str, float] = {}

    def watch() -> None:
        while "claimed" not in seen:
            try:
                if os.lstat(shm_arena.path(idx)).st_mtime > time.time():
                    seen.setdefault("extended", time.monotonic())
            except FileNotFoundError:
                seen["claimed"] = time.monotonic()
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    prompts = groups["filler"] + queued
    never_sent = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "no-such-producer",
        "remote_request_id": f"never-sent-{time.time_ns()}",
    }
    loads = pd.decode(prompts, [never_sent, params[0]], max_tokens=QUEUE_TOKENS)
    seen.setdefault("claimed", time.monotonic())
    t.join(10)
    waited = seen["claimed"] - sent
    assert "extended" in seen, f"no lease extension seen (claimed after {waited:.1f}s): {loads}"
    # without the extension the producer withdraws it after SEND_TTL (+ one lease check)
    assert waited > SEND_TTL + 1, f"the request waited only {waited:.1f}s: {loads[1]}"
    assert loads[0] is not None and loads[0]["ok"] is False, loads[0]  # the filler recomputed
    assert loads[1] is not None and loads[1]["ok"] is True, loads[1]
    assert loads[1]["tokens"] == len(queued[0])
    assert _until(_all_free)


def _claim_and_hang(namespace: str, jobs: Any, q: Any) -> None:
    """A consumer that claims a payload, holds it, and never finishes (until SIGKILL)."""
    from vllm_omni_kv import SharedMemoryConnector

    conn = SharedMemoryConnector({"namespace": namespace, "heartbeat_stale_s": STALE})
    q.put("ready")
    key, from_stage, to_stage = jobs.get(timeout=WAIT)
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:  # a streamed entry may be in progress
        got = conn.get(from_stage, to_stage, key)
        time.sleep(0.005)
    q.put("claimed" if got is not None else "missing")
    time.sleep(600)


def test_consumer_killed_after_claiming_leaves_nothing_and_later_requests_are_exact(
    pd: PD, groups: dict[str, list[list[int]]], tiny_model_dir: Path
) -> None:
    from vllm_omni_kv.backends.shm import arena as shm_arena
    from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, build_rank_aware_recv_keys

    prompts = groups["killed"]
    jobs, q = CTX.Queue(), CTX.Queue()
    reader = CTX.Process(target=_claim_and_hang, args=(NAMESPACE, jobs, q))
    reader.start()
    try:
        assert q.get(timeout=WAIT) == "ready"
        (p,) = pd.prefill(prompts)
        ((key, _rank),) = build_rank_aware_recv_keys(
            p["remote_transfer_id"], p["omni_from_stage"], p["omni_to_stage"], KVTPTopology(1, 1, 0)
        )
        jobs.put((key, p["omni_from_stage"], p["omni_to_stage"]))
        assert q.get(timeout=WAIT) == "claimed"
        assert not _index_entries()
        assert shm_arena.PUBLISHED in _segment_states().values()  # held by the reader
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(30)
        # the producer takes the segment back once the dead reader's lease is stale
        assert _until(_all_free), f"left: {_index_entries()} {_segment_states()}"
    finally:
        if reader.is_alive():
            os.kill(reader.pid, signal.SIGKILL)
            reader.join(30)
    # its payload is gone: the consumer engine recomputes that prompt, exactly
    (load,) = pd.decode(prompts, [p])
    assert load is not None and load["ok"] is False, load
    # and the next requests load over the reclaimed segment and give colocated tokens
    after = groups["after"]
    for load in pd.decode(after, list(pd.prefill(after))):
        assert load is not None and load["ok"] is True, load
    assert _until(_all_free)
    assert_cache_free(pd.prod, tiny_model_dir)
    assert_cache_free(pd.cons, tiny_model_dir)
