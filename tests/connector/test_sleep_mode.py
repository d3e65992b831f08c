"""vLLM 0.33's sleep mode through the connector's ``unregister_kv_caches`` /
``restore_kv_caches``, with vLLM's real scheduler and the real shm backend
(:mod:`sched_harness`, packed and one-copy payloads).

vLLM 0.32 (the CPU build here) cannot sleep, so the hooks are called where vLLM 0.33's
``Worker.sleep`` and ``wake_up`` call them, and the cache is overwritten in between, as
sleep discards it. The reference is the producer's cache: its bytes when the payload
was published (a packed payload is a copy of them), its bytes now after waking. A
failed load ends the request (the harness's ``kv_load_failure_policy`` is vLLM's
default, "fail"); ``test_pd_one_copy`` shows the recomputed tokens with engines.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from sched_harness import Engine, decode, prefill  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector  # noqa: E402

PROMPT = [(i * 7919) % 2003 + 1 for i in range(200)]
RECV_TIMEOUT = 6.0  # a voided payload is waited for this long, then recomputed


@pytest.fixture(scope="module", params=["packed", "one_copy"])
def pair(
    request: pytest.FixtureRequest, tiny_model_dir: Path
) -> Iterator[tuple[Engine, Engine, str]]:
    ns = f"sleep-{uuid.uuid4().hex[:8]}"
    mode = request.param
    share = {"backend_extra": {"namespace": ns, "share_cache": mode == "one_copy"}}
    prod = Engine(tiny_model_dir, "kv_producer", ns, seed=1, **share)
    cons = Engine(tiny_model_dir, "kv_consumer", ns, seed=2, recv_timeout=RECV_TIMEOUT, **share)
    try:
        yield prod, cons, mode
    finally:
        cons.close()
        prod.close()


def _sleep_and_wake(engine: Engine, seed: int) -> float:
    """vLLM 0.33's sleep and wake-up of ``engine`` (each hook twice: idempotent), its
    cache overwritten while asleep; the seconds ``unregister_kv_caches`` took."""
    t0 = time.monotonic()
    engine.worker.unregister_kv_caches()
    took = time.monotonic() - t0
    engine.worker.unregister_kv_caches()
    g = torch.Generator().manual_seed(seed)
    for cache in engine.caches.values():
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    engine.worker.restore_kv_caches()
    engine.worker.restore_kv_caches()
    return took


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_producer_sleeps_with_payloads_published(pair: tuple[Engine, Engine, str]) -> None:
    prod, cons, mode = pair
    rid = f"slept-{uuid.uuid4().hex[:6]}"
    prompt = [2001, *PROMPT[:99]]
    params = prefill(prod, rid, prompt)
    published = prod.kv(rid, 0, 100)
    _sleep_and_wake(prod, seed=11)
    if mode == "packed":  # a copy of the blocks: still good after the producer's sleep
        load = decode(prod, cons, rid, prompt, params)
        assert load["ok"] is True and load["tokens"] == 100, load
        assert _same(cons.kv(rid, 0, 100), published)
    else:  # the payload named blocks sleep discarded: voided, nothing of them read
        prod.run_until(lambda: rid in prod.sent, timeout=2)  # its blocks go back to vLLM
        cons.add(rid, prompt, dict(params))
        cons.run_until(lambda: rid in cons.finished)
        assert cons.reasons[rid] == FinishReason.ERROR  # the load failed
        slept = prod.kv(rid, 0, 100)
        got = cons.kv(rid, 0, 100)
        assert not any(torch.equal(a, b) for a, b in zip(got, slept, strict=True))
        assert prod.worker.worker_half.session.cache_region.generation == 2
    rid2 = f"woken-{uuid.uuid4().hex[:6]}"
    prompt2 = [2002, *PROMPT[:79]]
    load = decode(prod, cons, rid2, prompt2, prefill(prod, rid2, prompt2))
    assert load["ok"] is True and load["tokens"] == 80, load
    assert _same(cons.kv(rid2, 0, 80), prod.kv(rid2, 0, 80))


def test_a_consumer_sleeps_while_a_load_runs(pair: tuple[Engine, Engine, str]) -> None:
    prod, cons, _mode = pair
    rid = f"loaded-{uuid.uuid4().hex[:6]}"
    prompt = [2003, *PROMPT[:59]]
    params = prefill(prod, rid, prompt)
    assert decode(prod, cons, rid, prompt, params)["ok"]
    ghost = f"waiting-{uuid.uuid4().hex[:6]}"  # its payload is never published: the
    cons.add(ghost, [2004, *PROMPT[:59]], {**params, "remote_request_id": ghost})
    cons.step()  # load polls for it until recv_timeout, unless sleep stops it
    assert cons.sched.requests[ghost].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    took = _sleep_and_wake(cons, seed=12)
    assert took < RECV_TIMEOUT / 2, f"sleep waited {took:.1f}s for the load to stop"
    t0 = time.monotonic()
    cons.run_until(lambda: ghost in cons.finished)
    assert time.monotonic() - t0 < RECV_TIMEOUT / 2
    assert cons.reasons[ghost] == FinishReason.ERROR  # reported failed, not loaded
    rid2 = f"after-{uuid.uuid4().hex[:6]}"  # the woken consumer loads exactly again
    prompt2 = [2005, *PROMPT[:69]]
    load = decode(prod, cons, rid2, prompt2, prefill(prod, rid2, prompt2))
    assert load["ok"] is True and load["tokens"] == 70, load
    assert _same(cons.kv(rid2, 0, 70), prod.kv(rid2, 0, 70))


@pytest.mark.parametrize(
    ("backend", "extra", "supported"),
    [
        ("shm", {}, True),
        ("shm", {"share_cache": True}, True),
        ("cuda_ipc", {}, True),
        ("mooncake", {"role": "sender"}, True),
        ("mooncake", {"role": "sender", "register_cache": True}, False),  # RDMA: not run
        ("mooncake", {"role": "sender", "register_cache": True, "protocol": "tcp"}, True),
        ("nixl", {"role": "sender", "register_cache": True}, True),
        ("mooncake_store", {}, True),
    ],
)
def test_supports_sleep_mode_per_backend(backend: str, extra: dict, supported: bool) -> None:
    ktc = KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"backend": backend, "backend_extra": extra},
    )
    assert OmniKVConnector.supports_sleep_mode(ktc) is supported
