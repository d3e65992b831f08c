"""``V2CallsOmniKVConnector`` (``benchmarks/pd_load.py``'s V2 row): a V1 runner's
``start_load_kv``, called under the forward's context, reaches OmniKVConnector under a
forward context without attention metadata, as vLLM's V2 ``ActiveKVConnector`` calls it."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import VllmConfig  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector  # noqa: E402
from vllm_omni_kv.testing.v2_calls import V2CallsOmniKVConnector  # noqa: E402


def test_loads_start_without_attention_metadata_as_under_v2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []

    def record(self: OmniKVConnector, forward_context: Any, **kwargs: Any) -> None:
        seen.append((forward_context.attn_metadata, get_forward_context().attn_metadata, kwargs))

    monkeypatch.setattr(OmniKVConnector, "start_load_kv", record)
    conn = object.__new__(V2CallsOmniKVConnector)  # the call order only: no engine
    config = VllmConfig()
    conn._vllm_config = config
    with set_forward_context({"layer": "metadata"}, config):  # V1: the forward's context
        conn.start_load_kv(get_forward_context(), request_ids=["r"])
        assert get_forward_context().attn_metadata == {"layer": "metadata"}  # restored
    assert seen == [(None, None, {"request_ids": ["r"]})]
