"""Every call order vLLM 0.33 uses, through vLLM's real scheduler and the real connector
halves without engines (:mod:`sched_harness`; runs against vLLM 0.32 and 0.33):

* a speculator's deferred finalize: the step's results are taken before its saves, and
  the draft model writes KV with the metadata still bound (``v1-spec``: vLLM's V1 code in
  both versions; ``v2-spec``: V2's ``ActiveKVConnector`` in 0.33, emulated on 0.32);
* ``update_state_after_alloc`` of an async load a step late, or never (the request is
  freed first);
* worker outputs, finished ids and load outcomes, reaching the scheduler a step late.

The reference is the producer's own cache: after a load, every token must carry exactly
the producer's K and V, the draft model's writes included.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from _kv_fixtures import NBLOCKS  # noqa: E402
from sched_harness import (  # noqa: E402
    DEFERS_LOADS,
    SPEC_RUNNERS,
    Engine,
    decode,
    prefill,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_omni_kv.connector.metadata import OmniKVWorkerMetadata  # noqa: E402
from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector  # noqa: E402

PROMPT = [(i * 7919) % 2003 + 1 for i in range(200)]
MODES = ["packed", "one_copy"]


@contextmanager
def pair(model_dir: Path, mode: str, runner: str = "v1", **kw: Any) -> Iterator[list[Engine]]:
    ns = f"orders-{uuid.uuid4().hex[:8]}"
    share = {"backend_extra": {"namespace": ns, "share_cache": mode == "one_copy"}}
    prod = Engine(model_dir, "kv_producer", ns, seed=1, runner=runner, **share, **kw)
    cons = Engine(model_dir, "kv_consumer", ns, seed=2, runner=runner, **share, **kw)
    try:
        yield [prod, cons]
    finally:
        cons.close()
        prod.close()


def _same_kv(prod: Engine, cons: Engine, rid: str, n: int) -> None:
    for got, want in zip(cons.kv(rid, 0, n), prod.kv(rid, 0, n), strict=True):
        assert torch.equal(got, want)


def _prompt(first: int, n: int) -> list[int]:
    return [first, *PROMPT[: n - 1]]  # its own first token: no prefix hit anywhere


def _pools_free(*engines: Engine) -> bool:
    return all(
        e.sched.kv_cache_manager.block_pool.get_num_free_blocks() == NBLOCKS - 1 for e in engines
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", SPEC_RUNNERS)
def test_saves_run_after_the_draft_model(tiny_model_dir: Path, runner: str, mode: str) -> None:
    """With a speculator the save runs after the draft model wrote its KV: the consumer
    receives the draft layer as the producer holds it after the step."""
    with pair(tiny_model_dir, mode, runner) as (prod, cons):
        for i, n in enumerate((1, 33, 100)):
            rid, prompt = f"spec-{i}-{uuid.uuid4().hex[:6]}", _prompt(1900 + i, n)
            load = decode(prod, cons, rid, prompt, prefill(prod, rid, prompt))
            assert load["ok"] is True and load["tokens"] == n, load
            _same_kv(prod, cons, rid, n)
            if prod.drafts:  # the draft model's value of token 0, in the last layer
                k_last = prod.kv(rid, 0, n)[-2]
                assert torch.all(k_last[0] == ((prompt[0] * 31) % 97) / 8)
        prod.run_until(lambda: _pools_free(prod, cons))


@contextmanager
def alloc_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every ``update_state_after_alloc`` consumers' scheduler halves receive."""
    calls: list[Any] = []
    real = OmniKVConnector.update_state_after_alloc

    def spy(self: OmniKVConnector, request: Any, blocks: Any, n: int) -> None:
        if self.scheduler_half.is_consumer:
            calls.append(("alloc", request.request_id))
        real(self, request, blocks, n)

    monkeypatch.setattr(OmniKVConnector, "update_state_after_alloc", spy)
    yield calls


def test_update_state_after_alloc_a_step_late(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumer with two steps in flight: the load is admitted in one step and its
    ``update_state_after_alloc`` comes once the step before it was processed; the load
    lands whole."""
    with pair(tiny_model_dir, "one_copy") as (prod, cons), alloc_calls(monkeypatch) as calls:
        rid, prompt = f"deferred-{uuid.uuid4().hex[:6]}", _prompt(1950, 100)
        params = prefill(prod, rid, prompt)
        cons.add(f"busy-{rid}", _prompt(1951, 40), {})

        def admit() -> None:
            cons.add(rid, prompt, dict(params))
            calls.append("admitted")

        cons.overlapped(admit, lambda: calls.append("both scheduled"))
        assert calls[-3:] == ["admitted", "both scheduled", ("alloc", rid)], calls
        assert cons.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        cons.run_until(lambda: rid in cons.finished)
        prod.run_until(lambda: rid in prod.sent)
        load = (cons.finished[rid] or {})["omni_kv_load"]
        assert load["ok"] is True and load["tokens"] == 100, load
        _same_kv(prod, cons, rid, 100)


def test_a_request_freed_before_update_state_after_alloc(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request is aborted between its admission and its deferred
    ``update_state_after_alloc``, which never comes: no load starts, the producer's
    payload is released (its held blocks go back), and vLLM 0.33 frees the consumer's."""
    with pair(tiny_model_dir, "one_copy") as (prod, cons), alloc_calls(monkeypatch) as calls:
        rid, prompt = f"freed-{uuid.uuid4().hex[:6]}", _prompt(1960, 100)
        params = prefill(prod, rid, prompt)
        cons.add(f"busy-{rid}", _prompt(1961, 40), {})
        cons.overlapped(
            lambda: cons.add(rid, prompt, dict(params)),
            lambda: cons.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED),
        )
        cons.step()  # vLLM steps once more for the finished request: the release goes out
        prod.run_until(lambda: rid in prod.sent)  # the consumer released the payload
        assert ("alloc", rid) not in calls
        assert prod.worker.worker_half.session.held_payloads()[0] == 0
        if DEFERS_LOADS:  # vLLM 0.32 never defers, so it waits for the load's report
            cons.run_until(lambda: not cons.sched.requests and _pools_free(cons))
        prod.run_until(lambda: _pools_free(prod))


def test_a_request_never_allocated_releases_its_payload(tiny_model_dir: Path) -> None:
    """``get_num_new_matched_tokens`` without ``update_state_after_alloc`` in any vLLM:
    the consumer has no blocks for the request, which is then aborted; the producer's
    payload is released."""
    with pair(tiny_model_dir, "one_copy") as (prod, cons):
        rid, prompt = f"never-{uuid.uuid4().hex[:6]}", _prompt(1970, 100)
        params = prefill(prod, rid, prompt)
        pool = cons.sched.kv_cache_manager.block_pool
        taken = pool.get_new_blocks(pool.get_num_free_blocks())  # the cache is full
        cons.add(rid, prompt, dict(params))
        cons.step()
        assert cons.sched.requests[rid].status == RequestStatus.WAITING
        cons.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        pool.free_blocks(taken)
        cons.step()  # vLLM steps once more for the finished request: the release goes out
        prod.run_until(lambda: rid in prod.sent)
        cons.run_until(lambda: not cons.sched.requests and _pools_free(cons))
        prod.run_until(lambda: _pools_free(prod))


@pytest.mark.parametrize("mode", MODES)
def test_worker_outputs_a_step_late(tiny_model_dir: Path, mode: str) -> None:
    """Every worker output reaches its scheduler a step late (vLLM 0.33's replay of a
    failed worker's output): loads, their outcomes and the producer's releases all land."""
    with pair(tiny_model_dir, mode, late=True) as (prod, cons):
        for n in (1, 100):
            rid, prompt = f"late-{n}-{uuid.uuid4().hex[:6]}", _prompt(1980 + n % 7, n)
            load = decode(prod, cons, rid, prompt, prefill(prod, rid, prompt))
            assert load["ok"] is True and load["tokens"] == n, load
            _same_kv(prod, cons, rid, n)
        prod.run_until(lambda: _pools_free(prod, cons))


def test_a_rank_failure_in_another_step_stays_a_failure(tiny_model_dir: Path) -> None:
    """TP ranks' outcomes of one load reach the scheduler in different steps: another
    rank's failure and this worker's success, whichever comes first (the load may land in
    the step that starts it); the request's ``omni_kv_load`` says it failed, with this
    worker's bytes counted."""
    with pair(tiny_model_dir, "packed") as (prod, cons):
        rid, prompt = f"ranks-{uuid.uuid4().hex[:6]}", _prompt(1990, 100)
        params = prefill(prod, rid, prompt)
        cons.add(rid, prompt, dict(params))
        cons.step()  # the load is scheduled
        failed = {"ok": False, "tokens": 0, "bytes": 0, "seconds": 0.01, "error": "rank 1"}
        meta = OmniKVWorkerMetadata(loads={rid: failed})
        assert cons.sched.connector is not None
        cons.sched.connector.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=meta)
        )
        cons.run_until(lambda: rid in cons.finished)
        prod.run_until(lambda: rid in prod.sent)
        load = (cons.finished[rid] or {})["omni_kv_load"]
        assert load["ok"] is False and load["error"] == "rank 1", load
        assert load["bytes"] > 0  # this worker's bytes, merged in
