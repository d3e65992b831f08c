"""Two independent P/D deployments on one host, running at the same time with the same
prompts: no cross-talk, and one deployment's shutdown or start-up sweep never deletes the
other's live files.

Shared memory: each deployment has its own ``namespace``; a consumer handed the other
deployment's transfer params finds nothing (and recomputes), while the payload stays for
its own consumer. Mooncake TE, configured as users write it (neither ``role`` nor
``zmq_port``: both left to their defaults): both producers run with the default
side-channel port (a free one each), every consumer loads from its own producer, and one
consumer loads from both producers. A producer's own answers (greedy, no transfer
parameters) are the reference tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    NAMESPACE,
    EngineProc,
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
        "both": make_prompts(tiny_model_dir, 4, seed=41),
    }


def reference(prod: EngineProc, prompts: dict[str, list[list[int]]]) -> dict[tuple[int, ...], Any]:
    """``prod``'s own greedy tokens for every prompt (no transfer parameters)."""
    every = [p for g in prompts.values() for p in g]
    out = prod.generate(every, max_tokens=16)
    assert "error" not in out, out
    return {tuple(p): o["token_ids"] for p, o in zip(every, out["outputs"], strict=True)}


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


@pytest.fixture(scope="module")
def shm_deploys(
    tiny_model_dir: Path, prompts: dict[str, list[list[int]]]
) -> Iterator[tuple[list[EngineProc], dict[tuple[int, ...], Any]]]:
    """Deployments A and B (``prod_a, cons_a, prod_b, cons_b``), and the reference."""
    ns_a, ns_b = f"{NAMESPACE}-a", f"{NAMESPACE}-b"
    with engines(*shm_pair(tiny_model_dir, ns_a), *shm_pair(tiny_model_dir, ns_b)) as procs:
        yield procs, reference(procs[2], prompts)
    assert not ns_files(ns_a) and not ns_files(ns_b)


@pytest.mark.timeout(600)
def test_two_shm_deployments_keep_to_their_namespace(
    tiny_model_dir: Path,
    prompts: dict[str, list[list[int]]],
    shm_deploys: tuple[list[EngineProc], dict[tuple[int, ...], Any]],
) -> None:
    ns_a, ns_b = f"{NAMESPACE}-a", f"{NAMESPACE}-b"
    (prod_a, cons_a, prod_b, cons_b), ref = shm_deploys
    same = prompts["same"]
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
    for eng in (prod_a, cons_a):
        eng.request_stop()
    for eng in (prod_a, cons_a):
        eng.stop()
    assert not ns_files(ns_a), f"deployment A left files: {sorted(ns_files(ns_a))}"
    assert b_files <= ns_files(ns_b), "A's shutdown deleted B's live files"
    # a new engine of deployment A starts (its start-up sweep runs) while B's files live
    with engines(shm_pair(tiny_model_dir, ns_a)[0]):
        assert b_files <= ns_files(ns_b), "A's start-up sweep deleted B's live files"
    (loads,) = decode_all([(cons_b, live, pb)], ref)
    assert all(x["ok"] is True and x["tokens"] > 0 for x in loads), loads


#: what a user writes: no role (it follows kv_role), no zmq_port (a free port, advertised)
AS_WRITTEN = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 64 << 20}


def te_pair(model: Path, tag: str) -> tuple[tuple[str, Any], tuple[str, Any]]:
    prod = omni_ktc("kv_producer", backend="mooncake", backend_extra=dict(AS_WRITTEN))
    cons = omni_ktc(
        "kv_consumer", "recompute", backend="mooncake", recv_timeout=15.0,
        backend_extra=dict(AS_WRITTEN),
    )  # fmt: skip
    return (
        (f"faults-te-{tag}-producer", engine_cfg(model, prod)),
        (f"faults-te-{tag}-consumer", engine_cfg(model, cons)),
    )


@pytest.fixture(scope="module")
def te_deploys(
    tiny_model_dir: Path, prompts: dict[str, list[list[int]]]
) -> Iterator[tuple[list[EngineProc], dict[tuple[int, ...], Any]]]:
    """Mooncake TE deployments A and B (``prod_a, cons_a, prod_b, cons_b``), the reference."""
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    with engines(*te_pair(tiny_model_dir, "a"), *te_pair(tiny_model_dir, "b")) as procs:
        yield procs, reference(procs[0], prompts)


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_two_mooncake_deployments_with_default_ports(
    prompts: dict[str, list[list[int]]],
    te_deploys: tuple[list[EngineProc], dict[tuple[int, ...], Any]],
) -> None:
    (prod_a, cons_a, prod_b, cons_b), ref = te_deploys
    same = prompts["same"]
    pa, pb = prefill(prod_a, same), prefill(prod_b, same)
    port_a, port_b = {p["remote_port"] for p in pa}, {p["remote_port"] for p in pb}
    assert len(port_a) == len(port_b) == 1 and port_a != port_b, (port_a, port_b)
    assert 0 not in port_a | port_b
    for loads in decode_all([(cons_a, same, pa), (cons_b, same, pb)], ref):
        assert all(x["ok"] is True and x["tokens"] > 0 for x in loads), loads


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_two_default_producers_on_one_host_feed_one_consumer(
    prompts: dict[str, list[list[int]]],
    te_deploys: tuple[list[EngineProc], dict[tuple[int, ...], Any]],
) -> None:
    (prod_a, cons_a, prod_b, _), ref = te_deploys
    both = prompts["both"]  # prompts no engine has loaded
    params = prefill(prod_a, both[:2]) + prefill(prod_b, both[2:])
    ports = {p["remote_port"] for p in params}
    # each producer advertises the port its side channel bound: two, distinct, real
    assert len(ports) == 2 and all(isinstance(p, int) and p > 0 for p in ports), params
    (loads,) = decode_all([(cons_a, both, params)], ref)
    for load, ids in zip(loads, both, strict=True):
        assert load["ok"] is True and load["tokens"] == len(ids) and load["bytes"] > 0, load
