"""Configuration as users write it, with real engines: two Mooncake producers on one host
with neither ``role`` nor ``zmq_port`` (both left to their defaults) and one consumer that
also names no role; the consumer loads from both and answers as a colocated engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import engine_cfg, engines, make_prompts, omni_ktc

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.mooncake]

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine wheel is not installed")

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
#: what a user writes: no role (it follows kv_role), no zmq_port (a free port, advertised)
AS_WRITTEN = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 64 << 20}


@pytest.mark.timeout(600)
def test_two_default_producers_on_one_host_feed_one_consumer(tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, 4, seed=41)
    prod = omni_ktc("kv_producer", backend="mooncake", backend_extra=dict(AS_WRITTEN))
    cons = omni_ktc(
        "kv_consumer", "recompute", backend="mooncake", recv_timeout=15,
        backend_extra=dict(AS_WRITTEN),
    )  # fmt: skip
    with engines(
        ("cfg-producer-a", engine_cfg(tiny_model_dir, prod)),
        ("cfg-producer-b", engine_cfg(tiny_model_dir, prod)),
        ("cfg-consumer", engine_cfg(tiny_model_dir, cons)),
    ) as (a, b, c):
        # reference: producer a as an ordinary (colocated) engine, no transfer params
        ref = [o["token_ids"] for o in a.generate(prompts, max_tokens=16)["outputs"]]
        params = []
        for eng, half in ((a, prompts[:2]), (b, prompts[2:])):
            r = eng.generate(half, max_tokens=1, kv_transfer_params=[PREFILL] * len(half))
            assert "error" not in r, r
            params += [o["kv_transfer_params"] for o in r["outputs"]]
        ports = {p["remote_port"] for p in params}
        # each producer advertises the port its side channel bound: two, distinct, real
        assert len(ports) == 2 and all(isinstance(p, int) and p > 0 for p in ports), params
        got = c.generate(prompts, max_tokens=16, kv_transfer_params=params)
        assert "error" not in got, got
        for o, want, ids in zip(got["outputs"], ref, prompts):
            load = o["kv_transfer_params"]["omni_kv_load"]
            assert load["ok"] is True and load["tokens"] == len(ids) and load["bytes"] > 0, load
            assert o["token_ids"] == want
