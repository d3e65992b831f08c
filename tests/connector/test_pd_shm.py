"""Prefill/decode with real vLLM engines over shared memory with packed payloads
(``share_cache: false``): equivalence, failures and payload leases.

One producer and one consumer engine (``kv_load_failure_policy="recompute"``, a
``send_ttl`` of a few seconds, 65-block KV caches) serve every test of the module; the
producer, run as an ordinary engine before any transfer, gives the reference tokens
(greedy decoding of the same model), and the consumer's tokens must equal them in every
case. The connector's per-request load report (``kv_transfer_params["omni_kv_load"]``)
shows whether the KV was loaded. The lease tests also use a plain consumer process that
is SIGKILLed after claiming a payload; afterwards nothing is left: no index entry, every
arena segment back in the producer's pool (FREE), every KV block of both engines free.
The producer is killed by the last test.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _mp import CTX
from pd_helpers import (
    NAMESPACE,
    SMALL_CACHE_BLOCKS,
    EngineProc,
    assert_cache_free,
    engine_cfg,
    engines,
    kill_group,
    long_prompt,
    make_prompts,
    omni_ktc,
    sweep_dead_segments,
    whole_cache_prompt,
)

from vllm_omni_kv.backends.shm.inventory import ShmInventory, inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECV_TIMEOUT = 4.0
#: recompute + 16 decode steps of a few prompts on 2 CPU cores, and engine jitter
MARGIN = 15.0
#: long enough for a request to reach the consumer on a loaded 2-core machine
SEND_TTL = 4.0
STALE = 3.0  # heartbeat_stale_s: a dead reader's segment comes back after this
WAIT = 90.0
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
# tiny model: 2 layers, 2 KV heads, head size 64, fp32; whole 32-token blocks move
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
#: tokens the consumer generates while a second request waits for its blocks
QUEUE_TOKENS = 480
#: reference tokens of the two long-running requests: a prefix of their QUEUE_TOKENS
#: (it shows the loaded KV is right; later tokens come from the consumer's own decode)
LONG_REF_TOKENS = 32


class PD:
    def __init__(self, prod: EngineProc, cons: EngineProc):
        self.prod, self.cons = prod, cons
        self.ref: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prompts: list[list[int]], max_tokens: int) -> None:
        """The producer's own greedy tokens (no transfer parameters): the colocated answer."""
        out = self.prod.generate(prompts, max_tokens=max_tokens, timeout=300)
        assert "error" not in out, out
        self.ref.update({tuple(p): o["token_ids"] for p, o in zip(prompts, out["outputs"])})

    def prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        r = self.prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
        assert "error" not in r, r
        params = [o["kv_transfer_params"] for o in r["outputs"]]
        for p, ids in zip(params, prompts):
            assert p and p["do_remote_prefill"] is True and p["do_remote_decode"] is False
            assert p["remote_num_tokens"] == len(ids)
        return params

    def decode(
        self, prompts: list[list[int]], params: list[dict[str, Any] | None], max_tokens: int = 16
    ) -> dict[str, Any]:
        r = self.cons.generate(prompts, max_tokens=max_tokens, kv_transfer_params=params)
        assert "error" not in r, r
        for o, ids in zip(r["outputs"], prompts, strict=True):
            want = self.ref[tuple(ids)][:max_tokens]
            assert len(o["token_ids"]) == max_tokens and o["token_ids"][: len(want)] == want
        return r

    def loads(
        self, prompts: list[list[int]], params: list[dict[str, Any] | None], max_tokens: int = 16
    ) -> list[dict[str, Any] | None]:
        """:meth:`decode`, then each request's load report (None: no transfer parameters)."""
        r = self.decode(prompts, params, max_tokens)
        return [
            (o.get("kv_transfer_params") or {}).get("omni_kv_load") if p else None
            for o, p in zip(r["outputs"], params, strict=True)
        ]


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {
        "equal": make_prompts(tiny_model_dir, 4, seed=0),
        "missing": make_prompts(tiny_model_dir, 2, seed=1),
        "corrupt": make_prompts(tiny_model_dir, 2, seed=2),
        "killed": make_prompts(tiny_model_dir, 2, seed=3),
        "idle": make_prompts(tiny_model_dir, 1, seed=11),
        "reader_killed": make_prompts(tiny_model_dir, 1, seed=12),
        "after": make_prompts(tiny_model_dir, 2, seed=13),
        # more blocks (32) than the filler leaves free while it runs (15 of SMALL_CACHE_BLOCKS)
        "queued": [long_prompt(tiny_model_dir, 1000, seed=14)],
        "filler": [whole_cache_prompt(tiny_model_dir, QUEUE_TOKENS)],
    }


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, groups: dict[str, list[list[int]]]) -> Iterator[PD]:
    # packed frames (share_cache off): the one-copy default has its own module,
    # test_pd_one_copy; these tests corrupt, lease and reclaim packed segments
    extra = {
        "backend_extra": {"heartbeat_stale_s": STALE, "share_cache": False},
        "send_ttl": SEND_TTL,
    }
    prod_ktc = omni_ktc("kv_producer", backend="shm", **extra)
    cons_ktc = omni_ktc(
        "kv_consumer", "recompute", backend="shm", recv_timeout=RECV_TIMEOUT, **extra
    )
    small = {"num_gpu_blocks_override": SMALL_CACHE_BLOCKS}
    with engines(
        ("shm-producer", engine_cfg(tiny_model_dir, prod_ktc, **small)),
        ("shm-consumer", engine_cfg(tiny_model_dir, cons_ktc, **small)),
    ) as (prod, cons):
        pd = PD(prod, cons)
        for name, prompts in groups.items():
            pd.reference(prompts, LONG_REF_TOKENS if name in ("queued", "filler") else 16)
        yield pd


def _loads(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [o["kv_transfer_params"]["omni_kv_load"] for o in r["outputs"]]


def test_transferred_kv_gives_colocated_tokens(pd: PD, groups: dict[str, list[list[int]]]) -> None:
    prompts = groups["equal"]
    params = pd.prefill(prompts)
    r = pd.decode(prompts, params)
    for load, o, ids in zip(_loads(r), r["outputs"], prompts):
        assert load["ok"] is True, load
        assert load["tokens"] == len(ids)  # nothing cached locally: the whole prompt loaded
        assert load["bytes"] >= BYTES_PER_TOKEN * len(ids)
        # vLLM reports the producer's cache hits as the consumer's cached tokens
        assert o["num_cached_tokens"] == params[0].get("remote_prefill_cached_tokens", 0)


def test_local_prefix_hit_loads_only_the_last_block(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    # The consumer cached these prompts' blocks in the previous test: vLLM reports every
    # full block but the last as a local hit, and the load brings only the tokens after
    # it (fewer than a block), as vLLM's NixlConnector does.
    prompts = groups["equal"]
    r = pd.decode(prompts, pd.prefill(prompts))
    for load, ids in zip(_loads(r), prompts):
        tail = len(ids) - (len(ids) - 1) // 32 * 32
        assert load["ok"] is True and not load.get("local_hit"), load
        assert load["tokens"] == tail, load
        assert load["bytes"] >= BYTES_PER_TOKEN * tail, load


def test_missing_payload_recomputes_within_timeout(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    prompts = groups["missing"]
    params: list[dict[str, Any] | None] = [
        {
            "do_remote_prefill": True,
            "remote_engine_id": "no-such-producer",
            "remote_request_id": f"r{i}",
        }
        for i in range(len(prompts))
    ]
    t0 = time.monotonic()
    r = pd.decode(prompts, params)
    elapsed = time.monotonic() - t0
    assert elapsed < RECV_TIMEOUT + MARGIN, f"took {elapsed:.1f}s"
    for load in _loads(r):
        assert load["ok"] is False and "no KV payload" in load["error"], load
    log = "\n".join(pd.cons.log_lines)
    assert "KV load of request" in log and "within recv_timeout" in log


def _producer_segments(prod: EngineProc) -> list[str]:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    out = []
    for name in os.listdir(shm_arena.SHM_DIR):
        if not name.startswith(shm_arena.SEG_PREFIX):
            continue
        pid = shm_arena._owner_pid(name)
        try:
            if pid is not None and os.getpgid(pid) == prod.proc.pid:
                out.append(name)
        except ProcessLookupError:
            continue
    return out


def test_corrupted_payload_recomputes(pd: PD, groups: dict[str, list[list[int]]]) -> None:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    prompts = groups["corrupt"]
    params = pd.prefill(prompts)
    flipped = 0
    for name in _producer_segments(pd.prod):
        with open(os.path.join(shm_arena.SHM_DIR, name), "r+b") as f:
            state = struct.unpack("<I", f.read(4))[0]
            if state == shm_arena.FREE:
                continue
            off = shm_arena.DATA_OFFSET + 8192  # inside the tensor bytes of the frame
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
            flipped += 1
    assert flipped >= len(prompts), "found no published payload to corrupt"
    r = pd.decode(prompts, params)
    for load in _loads(r):
        assert load["ok"] is False and "checksum" in load["error"], load


def _until(cond: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _shm() -> ShmInventory:
    """What this run's shared-memory namespace holds (payloads, segments by state)."""
    return inventory(NAMESPACE)


def _all_free() -> bool:
    """No payload published or being claimed, every payload segment FREE."""
    inv = _shm()
    return inv.payloads == inv.transient == inv.segments_in_use == 0


def test_idle_producer_frees_an_unconsumed_payload_and_the_consumer_recomputes(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    prompts = groups["idle"]
    params = pd.prefill(prompts)
    assert _shm().payloads >= 1  # published
    # no further request reaches the producer: only its lease timer can withdraw it
    assert _until(_all_free), f"left: {_shm()}"
    (load,) = pd.loads(prompts, list(params))
    assert load is not None and load["ok"] is False and "no KV payload" in load["error"], load


def test_a_request_waiting_for_blocks_extends_its_payload_beyond_send_ttl(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    # The filler holds 49 of the consumer's 64 blocks, first while it waits recv_timeout
    # (4 s) for a payload that never comes, then while it recomputes and decodes
    # QUEUE_TOKENS tokens; the remote request needs 32 blocks, so it waits for all of that
    # (at least recv_timeout plus 480 decode steps, whatever the machine's speed), and
    # its scheduler extends the payload's lease meanwhile.
    from vllm_omni_kv.backends.shm import arena as shm_arena
    from vllm_omni_kv.backends.shm.connector import index_name
    from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, build_rank_aware_recv_keys

    queued = groups["queued"]
    params = pd.prefill(queued)
    sent = time.monotonic()
    p = params[0]
    ((key, _rank),) = build_rank_aware_recv_keys(
        p["remote_transfer_id"], p["omni_from_stage"], p["omni_to_stage"], KVTPTopology(1, 1, 0)
    )
    idx = index_name(NAMESPACE, p["omni_from_stage"], p["omni_to_stage"], key)
    assert _shm().payloads == 1 and os.path.exists(shm_arena.path(idx)), _shm()
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
    # the requests come 1.5 s after the payload: with the filler's recv_timeout, the queued
    # one is claimed past SEND_TTL + 1 however fast the machine decodes
    time.sleep(1.5)
    prompts = groups["filler"] + queued
    never_sent = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "no-such-producer",
        "remote_request_id": f"never-sent-{time.time_ns()}",
    }
    loads = pd.loads(prompts, [never_sent, params[0]], max_tokens=QUEUE_TOKENS)
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
    from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, build_rank_aware_recv_keys

    prompts = groups["reader_killed"]
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
        inv = _shm()
        assert inv.payloads == inv.transient == 0, inv
        assert inv.segment_states["published"] >= 1, inv  # held by the reader
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(30)
        # the producer takes the segment back once the dead reader's lease is stale
        assert _until(_all_free), f"left: {_shm()}"
    finally:
        if reader.is_alive():
            os.kill(reader.pid, signal.SIGKILL)
            reader.join(30)
    # its payload is gone: the consumer engine recomputes that prompt, exactly
    (load,) = pd.loads(prompts, [p])
    assert load is not None and load["ok"] is False, load
    # and the next requests load over the reclaimed segment and give colocated tokens
    after = groups["after"]
    for load in pd.loads(after, list(pd.prefill(after))):
        assert load is not None and load["ok"] is True, load
    assert _until(_all_free)
    assert_cache_free(pd.prod, tiny_model_dir)
    assert_cache_free(pd.cons, tiny_model_dir)


def test_killed_producer_never_hangs_nor_changes_tokens(
    pd: PD, groups: dict[str, list[list[int]]]
) -> None:
    # Runs last: the producer is gone afterwards. Its shared-memory payloads outlive it,
    # so the consumer either loads them (intact: verified by checksum) or recomputes.
    prompts = groups["killed"]
    params = pd.prefill(prompts)
    kill_group(pd.prod.proc.pid)
    pd.prod.proc.wait(timeout=30)
    t0 = time.monotonic()
    r = pd.decode(prompts, params)
    assert time.monotonic() - t0 < RECV_TIMEOUT + MARGIN
    assert all(isinstance(load["ok"], bool) for load in _loads(r))
    # and with no payload at all (what a producer killed before sending leaves):
    gone = [dict(p, remote_request_id=p["remote_request_id"] + "-never-sent") for p in params]
    pd.decode(prompts, gone)
    sweep_dead_segments(wait_s=30)
