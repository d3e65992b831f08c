"""Fault matrix with real engines: a producer killed mid-pull (Mooncake TE) and a producer
restarted while a consumer waits (Mooncake TE and shared memory).

Every case asserts greedy tokens equal to a colocated engine's (the producer's own answer
before the faults, without transfer parameters; a failed load is recomputed, never a hang: every wait is bounded) and that nothing leaked: the
consumer's receive pool takes a frame that needs almost all of it afterwards, the
restarted producer runs a request that needs its whole (small) KV cache, and the
autouse fixtures find no shared-memory file left behind.

Where in a pull the engine-level kill lands depends on timing (at the consumer's first
side-channel connection: the first head pull, or between two loads); the two
backend-level tests pull from a sender that is dead, and from one frozen mid-pull and
then killed, deterministically.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _pause import pause
from pd_helpers import (
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
    tcp_connected,
)

from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
#: recompute of a few prompts and 16 decode steps on 2 shared CPU cores, engine jitter
MARGIN = 60.0
#: the consumer waits this long for a payload; long enough to overlap a producer restart
RECV_TIMEOUT = 30.0
#: tiny model, fp32: 2 layers x (K, V) x 2 heads x 64 x 4 bytes per token
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
#: the follow-up prompt fills 64 blocks: a ~4 MiB frame
FOLLOW_UP_TOKENS = (SMALL_CACHE_BLOCKS - 1) * 32 - 16
#: the Mooncake consumer's receive pool: one follow-up frame fits, not with a leaked
#: frame of the kill batch (~3.6 MiB each) beside it
CONSUMER_POOL = 6 << 20


class Fixture:
    """Prompts of each case and their colocated greedy tokens."""

    def __init__(self, groups: dict[str, list[list[int]]]):
        self.groups = groups
        self.ref: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prod: EngineProc, names: tuple[str, ...]) -> None:
        """``prod``'s own greedy tokens (no transfer parameters) for the groups ``names``."""
        every = [p for n in names for p in self.groups[n]]
        out = prod.generate(every, max_tokens=16, timeout=300)
        assert "error" not in out, out
        self.ref.update({tuple(p): o["token_ids"] for p, o in zip(every, out["outputs"])})

    def check_tokens(self, r: dict[str, Any], prompts: list[list[int]]) -> list[dict[str, Any]]:
        """The consumer's loads, after asserting its tokens equal the colocated ones."""
        assert "error" not in r, r
        for o, ids in zip(r["outputs"], prompts, strict=True):
            assert o["token_ids"] == self.ref[tuple(ids)], "consumer tokens differ from colocated"
        return [o["kv_transfer_params"]["omni_kv_load"] for o in r["outputs"]]


@pytest.fixture(scope="module")
def fx(tiny_model_dir: Path) -> Fixture:
    groups = {
        # enough pulls (~45 MiB through a 6 MiB pool) that the kill lands mid-pull also when
        # this process is slow to be scheduled on a loaded machine; seeds apart from the
        # other groups', so the consumer's recompute of these caches none of their prefixes
        "kill": [long_prompt(tiny_model_dir, 1800 + 7 * i, seed=140 + i) for i in range(12)],
        "wait": make_prompts(tiny_model_dir, 2, seed=50),
        "after": [long_prompt(tiny_model_dir, FOLLOW_UP_TOKENS, seed=51)],
        "shm_after": make_prompts(tiny_model_dir, 2, seed=52),
    }
    return Fixture(groups)


def prefill(prod: EngineProc, prompts: list[list[int]]) -> list[Any]:
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
    assert "error" not in r, r
    return [o["kv_transfer_params"] for o in r["outputs"]]


class Background:
    """``fn`` on a thread; ``result`` joins it (bounded) and re-raises its error."""

    def __init__(self, fn: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.t0 = time.monotonic()

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> tuple[Any, float]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer within {timeout:.0f}s: a hang"
        if self.error is not None:
            raise self.error
        return self.value, time.monotonic() - self.t0


def never_sent(params: dict[str, Any], prompts: list[list[int]]) -> list[dict[str, Any] | None]:
    """Transfer params naming requests the producer (``params``' sender) never sent."""
    return [
        dict(params, remote_request_id=f"never-sent-{i}", remote_transfer_id=None)
        for i in range(len(prompts))
    ]


# -- Mooncake Transfer Engine ---------------------------------------------------------


def te_ktc(role: str, **backend: Any) -> dict[str, Any]:
    common = {"protocol": "tcp", "host": "127.0.0.1", "side_channel_timeout_s": 1.0}
    if role == "kv_producer":
        return omni_ktc(
            role,
            backend="mooncake",
            backend_extra={**common, "role": "sender", "memory_pool_size": 128 << 20, **backend},
        )
    return omni_ktc(
        role,
        "recompute",
        backend="mooncake",
        recv_timeout=RECV_TIMEOUT,
        load_threads=1,  # one receive block at a time: the pool check below is exact
        max_part_bytes=0,  # one frame per payload
        backend_extra={
            **common,
            "role": "receiver",
            "memory_pool_size": CONSUMER_POOL,
            "transfer_timeout_s": 5.0,
            **backend,
        },
    )


class TE:
    def __init__(self, prod: EngineProc, cons: EngineProc, port: int) -> None:
        self.prod, self.cons, self.port = prod, cons, port


@pytest.fixture(scope="module")
def te(tiny_model_dir: Path, fx: Fixture) -> Iterator[TE]:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    port = free_port()
    with engines(
        ("faults-te-producer", engine_cfg(tiny_model_dir, te_ktc("kv_producer", zmq_port=port))),
        ("faults-te-consumer", engine_cfg(tiny_model_dir, te_ktc("kv_consumer"))),
    ) as (prod, cons):
        fx.reference(prod, ("kill", "wait", "after"))
        yield TE(prod, cons, port)


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_producer_killed_mid_pull_recomputes(fx: Fixture, te: TE) -> None:
    prompts = fx.groups["kill"]
    params = prefill(te.prod, prompts)
    assert all(p["remote_port"] == te.port for p in params), params
    # frozen first: the pulls the consumer starts stay in flight until the kill (unfrozen,
    # a dozen loads of a few ms each could all end before a poll here saw them start)
    pause(te.prod.proc.pid, group=True)
    job = Background(lambda: te.cons.generate(prompts, 16, params, timeout=RECV_TIMEOUT + 300))
    # the consumer's first acquire opens its side-channel connection: a pull has started
    deadline = time.monotonic() + 120
    while not tcp_connected(te.port) and time.monotonic() < deadline and job.thread.is_alive():
        time.sleep(0.002)
    kill_group(te.prod.proc.pid)
    te.prod.proc.wait(timeout=30)
    r, elapsed = job.result(RECV_TIMEOUT + 400)
    loads = fx.check_tokens(r, prompts)
    failed = [x for x in loads if not x["ok"]]
    assert failed, f"every load finished before the kill: {loads}"
    for x in failed:
        assert x["error"] and x["tokens"] == 0, x
    assert elapsed < RECV_TIMEOUT + len(prompts) * 2 + MARGIN + 120, f"took {elapsed:.0f}s"


@pytest.mark.mooncake
@pytest.mark.timeout(900)
def test_te_producer_restarted_while_consumer_waits(
    fx: Fixture, te: TE, tiny_model_dir: Path
) -> None:
    waiting = fx.groups["wait"]
    endpoint = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "killed-before-sending",
        "remote_host": "127.0.0.1",
        "remote_port": te.port,
    }
    job = Background(
        lambda: te.cons.generate(waiting, 16, never_sent(endpoint, waiting), timeout=600)
    )
    kill_group(te.prod.proc.pid)  # still running when this test runs alone
    te.prod.proc.wait(timeout=30)
    cfg = engine_cfg(
        tiny_model_dir,
        te_ktc("kv_producer", zmq_port=te.port),
        num_gpu_blocks_override=SMALL_CACHE_BLOCKS,
    )
    with engines(("faults-te-producer-2", cfg)) as (prod2,):
        r, elapsed = job.result(RECV_TIMEOUT + 600)
        for load in fx.check_tokens(r, waiting):
            assert load["ok"] is False and "no KV payload" in load["error"], load
        # a new request goes through the new producer on the same port; its ~4 MiB frame
        # needs most of the consumer's receive pool: nothing of the killed pulls is held
        after = fx.groups["after"]
        params = prefill(prod2, after)
        assert params[0]["remote_port"] == te.port
        for load in fx.check_tokens(te.cons.generate(after, 16, params), after):
            assert load["ok"] is True and load["tokens"] == len(after[0]), load
            assert load["bytes"] >= BYTES_PER_TOKEN * len(after[0]), load
        assert_cache_free(prod2, tiny_model_dir)


SENDER = """
import json, sys, torch
from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector
c = MooncakeTransferEngineConnector(json.loads(sys.argv[1]))
ok, size, meta = c.put("prefill", "decode", "big", {"kv": torch.ones(1 << 20)})  # 4 MiB
print(json.dumps(meta), flush=True)
sys.stdin.read()
"""


TE_LOOPBACK = {"host": "127.0.0.1", "protocol": "tcp", "side_channel_timeout_s": 1.0}


def start_sender() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A sender process holding one ~4 MiB frame, and that frame's put metadata."""
    cfg = {**TE_LOOPBACK, "role": "sender", "zmq_port": 0, "memory_pool_size": 16 << 20}
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert sender.stdout is not None
        meta = json.loads(sender.stdout.readline())
    except BaseException:
        kill_group(sender.pid)
        sender.wait(timeout=30)
        raise
    assert meta["data_size"] > 4 << 20 and not meta["is_fast_path"], meta
    return sender, meta


def receiver() -> Any:
    """A receiver whose 8 MiB pool holds one frame of :func:`start_sender`, not two."""
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    return MooncakeTransferEngineConnector(
        {**TE_LOOPBACK, "role": "receiver", "memory_pool_size": 8 << 20, "transfer_timeout_s": 5.0}
    )


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_pull_from_killed_sender_returns_the_receive_block() -> None:
    # The receiver pulls straight from the put metadata (no side-channel round trip), so
    # the pull itself meets the dead sender. Regression: the failed read's traceback
    # kept the receive block through a reference cycle (the pool ran out, see above).
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    sender, meta = start_sender()
    kill_group(sender.pid)
    sender.wait(timeout=30)
    recv = receiver()
    gc.disable()  # the block must come back by reference counting, not a GC pass
    try:
        for _ in range(3):  # each would hold 4 MiB of the 8 MiB pool if it leaked
            with pytest.raises(KVTransferError, match="failed"):
                recv.open_stream("prefill", "decode", "big", meta)
        assert recv.pool.stats()["live_buffers"] == 0, recv.pool.stats()
    finally:
        gc.enable()
        recv.close()


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_sender_killed_during_a_pull_ends_it_cleanly() -> None:
    # The sender is frozen (SIGSTOP) so that the pull is certainly in flight, then killed.
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

    sender, meta = start_sender()
    recv = receiver()
    try:
        pause(sender.pid, group=True)
        job = Background(lambda: recv.open_stream("prefill", "decode", "big", meta))
        time.sleep(1.0)  # the pull waits on the frozen sender
        kill_group(sender.pid)
        sender.wait(timeout=30)
        # ends within transfer_timeout_s (a failed read, or a stalled one abandoned)
        try:
            stream, _elapsed = job.result(30)
        except KVTransferError:
            stream = None
        assert stream is None
        deadline = time.monotonic() + 30  # an abandoned read frees the block when it ends
        while recv.pool.stats()["live_buffers"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recv.pool.stats()["live_buffers"] == 0, recv.pool.stats()
        # and the pool takes a whole frame again (a fresh sender)
        sender2, meta2 = start_sender()
        try:
            stream = recv.open_stream("prefill", "decode", "big", meta2)
            assert stream is not None
            with stream:
                for _ in stream.load(None, time.monotonic() + 30):
                    pass
        finally:
            kill_group(sender2.pid)
            sender2.wait(timeout=30)
    finally:
        kill_group(sender.pid)
        recv.close()


# -- shared memory --------------------------------------------------------------------


@pytest.fixture(scope="module")
def shm(tiny_model_dir: Path, fx: Fixture) -> Iterator[tuple[EngineProc, EngineProc]]:
    """A shared-memory producer (small KV cache) and a consumer that waits RECV_TIMEOUT."""
    cons_ktc = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=RECV_TIMEOUT)
    with engines(
        ("faults-shm-producer", shm_producer_cfg(tiny_model_dir)),
        ("faults-shm-consumer", engine_cfg(tiny_model_dir, cons_ktc)),
    ) as (prod, cons):
        fx.reference(prod, ("wait", "shm_after"))
        yield prod, cons


def shm_producer_cfg(model: Path) -> dict[str, Any]:
    return engine_cfg(
        model, omni_ktc("kv_producer", backend="shm"), num_gpu_blocks_override=SMALL_CACHE_BLOCKS
    )


@pytest.mark.timeout(900)
def test_shm_producer_restarted_while_consumer_waits(
    fx: Fixture, shm: tuple[EngineProc, EngineProc], tiny_model_dir: Path
) -> None:
    prod, cons = shm
    waiting = fx.groups["wait"]
    # the producer's real engine id; requests it is killed before sending
    sent = prefill(prod, waiting[:1])[0]
    job = Background(lambda: cons.generate(waiting, 16, never_sent(sent, waiting), timeout=600))
    kill_group(prod.proc.pid)
    prod.proc.wait(timeout=30)
    sweep_dead_segments(wait_s=30)  # what the killed producer left (its arena)
    with engines(("faults-shm-producer-2", shm_producer_cfg(tiny_model_dir))) as (prod2,):
        r, elapsed = job.result(RECV_TIMEOUT + 600)
        for load in fx.check_tokens(r, waiting):
            assert load["ok"] is False and "no KV payload" in load["error"], load
        after = fx.groups["shm_after"]
        params = prefill(prod2, after)
        for load, ids in zip(
            fx.check_tokens(cons.generate(after, 16, params), after), after, strict=True
        ):
            assert load["ok"] is True and load["tokens"] == len(ids), load
        assert_cache_free(prod2, tiny_model_dir)
