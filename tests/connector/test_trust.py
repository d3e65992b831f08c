"""Trusted producers: which ``kv_transfer_params`` endpoints a consumer pulls from."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_omni_kv.connector.config import TrustedProducers, parse_omni_kv_config
from vllm_omni_kv.connector.scheduler import OmniKVScheduler
from vllm_omni_kv.errors import ConfigError


def _consumer(**extra: Any) -> OmniKVScheduler:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return OmniKVScheduler(vllm_config, parse_omni_kv_config(extra), "consumer")  # type: ignore[arg-type]


def _request(host: str | None, port: int | None = 15000) -> SimpleNamespace:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": "producer",
        "remote_request_id": "r1",
    }
    if host is not None:
        params.update(remote_host=host, remote_port=port)
    return SimpleNamespace(
        request_id="r1",
        kv_transfer_params=params,
        num_prompt_tokens=200,
        prompt_token_ids=[1] * 200,
    )


def test_trusted_producers_parse_and_match() -> None:
    t = TrustedProducers.parse(["10.0.0.5:15000", "decode-7", "[fd00::1]:9", "fd00::2"])
    assert t.allows("10.0.0.5", 15000) and not t.allows("10.0.0.5", 15001)
    assert t.allows("decode-7", 1) and t.allows("fd00::1", 9) and t.allows("fd00::2", 5)
    assert t.allows("127.0.0.1", 1) and t.allows("::1", 1) and t.allows("localhost", 1)
    assert not t.allows("10.0.0.6", 15000)
    assert TrustedProducers.parse("*").allows("203.0.113.9", 1)
    for bad in ("10.0.0.5", ["x:notaport"], [3]):
        with pytest.raises(ConfigError, match="trusted_producers"):
            TrustedProducers.parse(bad)


def test_untrusted_endpoint_is_computed_locally(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_omni_kv.connector import scheduler
    from vllm_omni_kv.logger import LogBudget

    # a fresh budget: other tests in this process may have spent the module's refusal lines
    monkeypatch.setattr(scheduler, "_per_request", LogBudget(scheduler.logger))
    sched = _consumer()
    assert sched.get_num_new_matched_tokens(_request("127.0.0.1"), 0) == (200, True)
    assert sched.get_num_new_matched_tokens(_request(None), 0) == (200, True)  # shared memory
    with caplog.at_level("WARNING"):
        assert sched.get_num_new_matched_tokens(_request("203.0.113.9"), 0) == (0, False)
    assert "not in kv_connector_extra_config.trusted_producers" in caplog.text


def test_configured_and_own_endpoints_are_trusted() -> None:
    sched = _consumer(trusted_producers=["203.0.113.9:15000"], remote_host="198.51.100.4")
    assert sched.get_num_new_matched_tokens(_request("203.0.113.9"), 0) == (200, True)
    assert sched.get_num_new_matched_tokens(_request("203.0.113.9", 15016), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_request("198.51.100.4", 1), 0) == (200, True)
    assert _consumer(trusted_producers="*").get_num_new_matched_tokens(
        _request("192.0.2.1"), 0
    ) == (200, True)
