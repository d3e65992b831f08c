"""``kv_load_failure_policy="fail"`` (vLLM's default) and configuration errors at start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import PRELOAD, EngineProc, engine_cfg, engines, make_prompts, omni_ktc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECV_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def fail_consumer(tiny_model_dir: Path) -> Iterator[EngineProc]:
    # no kv_load_failure_policy: vLLM's default, "fail"
    ktc = omni_ktc("kv_consumer", backend="shm", recv_timeout=RECV_TIMEOUT)
    with engines(("fail-consumer", engine_cfg(tiny_model_dir, ktc))) as (cons,):
        yield cons


def test_missing_payload_fails_the_request_clearly(
    fail_consumer: EngineProc, tiny_model_dir: Path
) -> None:
    prompts = make_prompts(tiny_model_dir, 2, seed=7)
    params = [
        {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": f"x{i}"}
        for i in range(len(prompts))
    ]
    t0 = time.monotonic()
    r = fail_consumer.generate(prompts, max_tokens=16, kv_transfer_params=params)
    elapsed = time.monotonic() - t0
    assert elapsed < RECV_TIMEOUT + 15, f"took {elapsed:.1f}s"
    assert "error" not in r, r
    for o in r["outputs"]:
        assert o["finish_reason"] == "error", o
        assert o["token_ids"] == []  # never a wrong token
    log = "\n".join(fail_consumer.log_lines)
    assert "KV load of request" in log and "no KV payload" in log
    assert "failure_policy=fail" in log  # vLLM's own line naming the policy


def test_bad_extra_config_fails_at_engine_start(tiny_model_dir: Path) -> None:
    ktc = omni_ktc("kv_consumer", backend="shm", recv_timeout=-1)
    proc = EngineProc(engine_cfg(tiny_model_dir, ktc), preloaded=PRELOAD)
    try:
        with pytest.raises(RuntimeError):
            proc.wait_ready(timeout=180)
        assert (
            "kv_connector_extra_config.recv_timeout must be a number of seconds > 0"
            in proc.tail(400)
        )
    finally:
        proc.stop()
