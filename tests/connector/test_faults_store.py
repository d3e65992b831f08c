"""Fault matrix with real engines and a real ``mooncake_master``: the master down when the
connector starts, and killed (then restarted) while producer and consumer run.

Master down at start: the engine does not start, and says which master address it could
not reach (after ``connect_timeout_s``, not the store client's ~90 s of retries). Master
killed mid-run: loads fail cleanly and vLLM recomputes (tokens equal a colocated
engine's: the producer's own answer before the master is killed; bounded by ``recv_timeout``); once the master is back on the same address,
loads succeed again (the store client reconnects; keys stored before are gone).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    PRELOAD,
    SMALL_CACHE_BLOCKS,
    EngineProc,
    assert_cache_free,
    engine_cfg,
    engines,
    make_prompts,
    omni_ktc,
)

from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.mooncake]

pytest.importorskip("mooncake.store", reason="the Mooncake store is not installed")

from vllm_omni_kv.backends.mooncake_store.connector import MooncakeStoreConnector  # noqa: E402
from vllm_omni_kv.backends.mooncake_store.master import (  # noqa: E402
    MasterHandle,
    mooncake_master,
    stop_process,
)

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
RECV_TIMEOUT = 8.0
#: recompute of a few prompts and 16 decode steps on 2 shared CPU cores, engine jitter
MARGIN = 60.0


def store_ktc(role: str, backend_extra: dict[str, Any]) -> dict[str, Any]:
    if role == "kv_producer":
        return omni_ktc(role, backend="mooncake_store", backend_extra=backend_extra)
    return omni_ktc(
        role,
        "recompute",
        backend="mooncake_store",
        recv_timeout=RECV_TIMEOUT,
        backend_extra=backend_extra,
    )


@pytest.mark.timeout(60)
def test_store_connector_refuses_to_start_without_master() -> None:
    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match=f"Mooncake master at {master} does not accept"):
        MooncakeStoreConnector({"master": master, "connect_timeout_s": 1.0})
    # bounded by connect_timeout_s, not by the store client's own retries (~90 s)
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(400)
def test_engine_with_master_down_fails_at_start_naming_it(tiny_model_dir: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    extra = {
        "master": master,
        "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
        "connect_timeout_s": 2.0,
    }
    proc = EngineProc(
        engine_cfg(tiny_model_dir, store_ktc("kv_consumer", extra)), preloaded=PRELOAD
    )
    try:
        with pytest.raises(RuntimeError):
            proc.wait_ready(timeout=300)
        tail = proc.tail(400)
        assert f"Mooncake master at {master} does not accept connections" in tail, tail[-3000:]
        assert "KVTransferError" in tail
    finally:
        proc.stop()


@contextlib.contextmanager
def restarted(m: MasterHandle, timeout: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """The master ``m`` ran, started again on the same ports; always stopped."""
    proc = subprocess.Popen(
        m.proc.args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while not (_listens(m.rpc_port) and _listens(m.http_port)):
            assert proc.poll() is None, f"mooncake_master exited with {proc.returncode}"
            assert time.monotonic() < deadline, "restarted mooncake_master does not listen"
            time.sleep(0.05)
        yield proc
    finally:
        stop_process(proc)


def _listens(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class PD:
    def __init__(self, prod: EngineProc, cons: EngineProc, ref: dict[tuple[int, ...], list[int]]):
        self.prod, self.cons, self.ref = prod, cons, ref

    def run(self, prompts: list[list[int]]) -> tuple[list[dict[str, Any]], float]:
        """Prefill on the producer, decode on the consumer; the loads and the decode's
        seconds, after asserting colocated-equal tokens."""
        r = self.prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
        assert "error" not in r, r
        params = [o["kv_transfer_params"] for o in r["outputs"]]
        t0 = time.monotonic()
        r = self.cons.generate(prompts, max_tokens=16, kv_transfer_params=params)
        elapsed = time.monotonic() - t0
        assert "error" not in r, r
        for o, ids in zip(r["outputs"], prompts, strict=True):
            assert o["token_ids"] == self.ref[tuple(ids)], "consumer tokens differ from colocated"
        return [o["kv_transfer_params"]["omni_kv_load"] for o in r["outputs"]], elapsed


@pytest.fixture(scope="module")
def store(tiny_model_dir: Path) -> Iterator[tuple[MasterHandle, PD, list[list[list[int]]]]]:
    """A master, a producer (small KV cache) and a consumer, and four prompt groups."""
    groups = [make_prompts(tiny_model_dir, 2, seed=60 + i) for i in range(4)]
    with mooncake_master() as m:
        extra = m.store_config(connect_timeout_s=5.0)
        prod_cfg = engine_cfg(
            tiny_model_dir,
            store_ktc("kv_producer", extra),
            num_gpu_blocks_override=SMALL_CACHE_BLOCKS,
        )
        with engines(
            ("faults-store-producer", prod_cfg),
            ("faults-store-consumer", engine_cfg(tiny_model_dir, store_ktc("kv_consumer", extra))),
        ) as (prod, cons):
            every = [p for g in groups for p in g]
            out = prod.generate(every, max_tokens=16)  # reference: no transfer parameters
            assert "error" not in out, out
            ref = {tuple(p): o["token_ids"] for p, o in zip(every, out["outputs"])}
            yield m, PD(prod, cons, ref), groups


@pytest.mark.timeout(900)
def test_master_killed_mid_run_recomputes_then_recovers(
    tiny_model_dir: Path, store: tuple[MasterHandle, PD, list[list[list[int]]]]
) -> None:
    m, pd, groups = store
    prod = pd.prod
    loads, _ = pd.run(groups[0])
    assert all(x["ok"] is True and x["bytes"] > 0 for x in loads), loads

    m.proc.kill()
    m.proc.wait(timeout=30)
    loads, elapsed = pd.run(groups[1])
    for x in loads:
        assert x["ok"] is False and "no KV payload" in x["error"], x
        assert f"Mooncake master at {m.master_address} is unreachable" in x["error"], x
    assert elapsed < RECV_TIMEOUT + MARGIN, f"took {elapsed:.0f}s"
    # the failed sends did not keep the producer's blocks
    assert_cache_free(prod, tiny_model_dir)

    with restarted(m):
        # the store client reconnects on its own; give it a few rounds
        for prompts in groups[2:]:
            loads, _ = pd.run(prompts)
            if all(x["ok"] for x in loads):
                break
            time.sleep(2)
        else:
            pytest.fail(f"loads still fail after the master came back: {loads}")
        for x in loads:
            assert x["bytes"] > 0, x
        assert_cache_free(prod, tiny_model_dir)
