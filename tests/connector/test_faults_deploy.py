"""Two independent P/D deployments on one host, running at the same time with the same
prompts: no cross-talk, and one deployment's shutdown or start-up sweep never deletes the
other's live files.

Shared memory: each deployment has its own ``namespace``; a consumer handed the other
deployment's transfer params finds nothing (and recomputes), while the payload stays for
its own consumer. Mooncake TE: both producers run with the default side-channel port
(a free one each) and every consumer loads from its own producer.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    NAMESPACE,
    EngineProc,
    colocated_reference,
    engine_cfg,
    engines,
    make_prompts,
    omni_ktc,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
RECV_TIMEOUT = 6.0
MARGIN = 60.0


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {
        "same": make_prompts(tiny_model_dir, 3, seed=70),
        "live": make_prompts(tiny_model_dir, 2, seed=71),
        "cross": make_prompts(tiny_model_dir, 2, seed=72),
    }


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path, prompts: dict[str, list[list[int]]]) -> dict[tuple[int, ...], Any]:
    every = [p for g in prompts.values() for p in g]
    return colocated_reference(tiny_model_dir, every, 16, "faults-deploy-colocated")


def prefill(prod: EngineProc, batch: list[list[int]]) -> list[Any]:
    r = prod.generate(batch, max_tokens=1, kv_transfer_params=[PREFILL] * len(batch))
    assert "error" not in r, r
    return [o["kv_transfer_params"] for o in r["outputs"]]


def decode_all(
    jobs: list[tuple[EngineProc, list[list[int]], list[Any]]],
    ref: dict[tuple[int, ...], Any],
) -> list[list[dict[str, Any]]]:
    """Decode on every consumer at once; each one's loads, after asserting its tokens."""
    out: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        cons, batch, params = jobs[i]
        try:
            out[i] = cons.generate(batch, 16, params, timeout=RECV_TIMEOUT + 240)
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RECV_TIMEOUT + 300)
        assert not t.is_alive(), "a consumer gave no answer: a hang"
    loads = []
    for r, (_cons, batch, _p) in zip(out, jobs, strict=True):
        if isinstance(r, BaseException):
            raise r
        assert "error" not in r, r
        for o, ids in zip(r["outputs"], batch, strict=True):
            assert o["token_ids"] == ref[tuple(ids)], "consumer tokens differ from colocated"
        loads.append([o["kv_transfer_params"]["omni_kv_load"] for o in r["outputs"]])
    return loads


def ns_files(namespace: str) -> set[str]:
    from vllm_omni_kv.backends.shm import arena as shm_arena

    return shm_arena.namespace_files(namespace)


def shm_pair(model: Path, namespace: str) -> tuple[tuple[str, Any], tuple[str, Any]]:
    tag = namespace.rsplit("-", 1)[1]
    extra = {"namespace": namespace}
    prod = omni_ktc("kv_producer", backend="shm", backend_extra=extra)
    cons = omni_ktc(
        "kv_consumer", "recompute", backend="shm", recv_timeout=RECV_TIMEOUT, backend_extra=extra
    )
    return (
        (f"faults-shm-{tag}-producer", engine_cfg(model, prod)),
        (f"faults-shm-{tag}-consumer", engine_cfg(model, cons)),
    )


@pytest.mark.timeout(1200)
def test_two_shm_deployments_keep_to_their_namespace(
    tiny_model_dir: Path, prompts: dict[str, list[list[int]]], ref: dict[tuple[int, ...], Any]
) -> None:
    ns_a, ns_b = f"{NAMESPACE}-a", f"{NAMESPACE}-b"
    same = prompts["same"]
    with engines(*shm_pair(tiny_model_dir, ns_b)) as (prod_b, cons_b):
        with engines(*shm_pair(tiny_model_dir, ns_a)) as (prod_a, cons_a):
            # identical prompts in both, decoded at the same time: each loads its own
            pa, pb = prefill(prod_a, same), prefill(prod_b, same)
            for loads in decode_all([(cons_a, same, pa), (cons_b, same, pb)], ref):
                assert all(x["ok"] is True and x["tokens"] > 0 for x in loads), loads
            # a consumer handed the other deployment's params finds nothing in its
            # namespace (recomputes), and does not take the payload from its owner
            # (prompts neither consumer has cached)
            cross = prompts["cross"]
            pb = prefill(prod_b, cross)
            t0 = time.monotonic()
            (crossed,) = decode_all([(cons_a, cross, pb)], ref)
            assert time.monotonic() - t0 < RECV_TIMEOUT + MARGIN
            for x in crossed:
                assert x["ok"] is False and "no KV payload" in x["error"], x
            (own,) = decode_all([(cons_b, cross, pb)], ref)
            assert all(x["ok"] is True and x["tokens"] > 0 for x in own), own
            # B publishes payloads nobody has read yet; then A shuts down
            live = prompts["live"]
            pb = prefill(prod_b, live)
            b_files = ns_files(ns_b)
            assert b_files, "deployment B published nothing in its namespace"
        assert not ns_files(ns_a), f"deployment A left files: {sorted(ns_files(ns_a))}"
        assert b_files <= ns_files(ns_b), "A's shutdown deleted B's live files"
        # a new engine of deployment A starts (its start-up sweep runs) while B's files live
        with engines(shm_pair(tiny_model_dir, ns_a)[0]):
            assert b_files <= ns_files(ns_b), "A's start-up sweep deleted B's live files"
        (loads,) = decode_all([(cons_b, live, pb)], ref)
        assert all(x["ok"] is True and x["tokens"] > 0 for x in loads), loads
    assert not ns_files(ns_a) and not ns_files(ns_b)


def te_pair(model: Path, tag: str) -> tuple[tuple[str, Any], tuple[str, Any]]:
    common = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 64 << 20}
    # no zmq_port: the default (a free port per server) must keep deployments apart
    prod = omni_ktc("kv_producer", backend="mooncake", backend_extra={**common, "role": "sender"})
    cons = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="mooncake",
        recv_timeout=15.0,
        backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0},
    )
    return (
        (f"faults-te-{tag}-producer", engine_cfg(model, prod)),
        (f"faults-te-{tag}-consumer", engine_cfg(model, cons)),
    )


@pytest.mark.mooncake
@pytest.mark.timeout(1200)
def test_two_mooncake_deployments_with_default_ports(
    tiny_model_dir: Path, prompts: dict[str, list[list[int]]], ref: dict[tuple[int, ...], Any]
) -> None:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    same = prompts["same"]
    with engines(*te_pair(tiny_model_dir, "a"), *te_pair(tiny_model_dir, "b")) as procs:
        prod_a, cons_a, prod_b, cons_b = procs
        pa, pb = prefill(prod_a, same), prefill(prod_b, same)
        port_a, port_b = {p["remote_port"] for p in pa}, {p["remote_port"] for p in pb}
        assert len(port_a) == len(port_b) == 1 and port_a != port_b, (port_a, port_b)
        assert 0 not in port_a | port_b
        for loads in decode_all([(cons_a, same, pa), (cons_b, same, pb)], ref):
            assert all(x["ok"] is True and x["tokens"] > 0 for x in loads), loads
