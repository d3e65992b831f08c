"""``V2CallsOmniKVConnector`` (``benchmarks/pd_load.py``'s V2 row): a V1 runner's
``start_load_kv``, called under the forward's context, reaches OmniKVConnector under a
forward context without attention metadata, as vLLM's V2 ``ActiveKVConnector`` calls it.
``V2SpecCallsOmniKVConnector``: the step's calls arrive in the order vLLM's runners use
with a speculator (saves after the step's results and the draft model)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import VllmConfig  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402

from vllm_omni_kv.connector.metadata import OmniKVConnectorMetadata  # noqa: E402
from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector  # noqa: E402
from vllm_omni_kv.testing.kv_agent import kv_agent  # noqa: E402
from vllm_omni_kv.testing.v2_calls import (  # noqa: E402
    V2CallsOmniKVConnector,
    V2SpecCallsOmniKVConnector,
)


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


# -- the speculator's deferred finalize -----------------------------------------------------
#: the OmniKVConnector calls a step makes, in the order vLLM's runners make them
STEP_CALLS = (
    "start_load_kv",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


def _recording(monkeypatch: pytest.MonkeyPatch, cls: type[OmniKVConnector]) -> Any:
    """A ``cls`` without an engine whose OmniKVConnector calls are recorded with whether
    the step's metadata was bound then."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorTransferResults,
    )

    calls: list[tuple[str, bool]] = []

    def record(name: str) -> Any:
        def call(self: OmniKVConnector, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, self.has_connector_metadata()))
            if name == "clear_connector_metadata":
                KVConnectorBase_V1.clear_connector_metadata(self)
            if name == "get_transfer_results":
                return KVConnectorTransferResults(set(), set(), set())
            return set() if name == "get_block_ids_with_load_errors" else None

        return call

    for name in STEP_CALLS:
        monkeypatch.setattr(OmniKVConnector, name, record(name))
    conn = object.__new__(cls)
    conn._vllm_config = VllmConfig()
    conn._connector_metadata = None
    conn.calls = calls
    return conn


def _empty_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.kv_connector_metadata = OmniKVConnectorMetadata()
    return so


def _v1_step(conn: OmniKVConnector, *, defer: bool) -> list[tuple[str, bool]]:
    """One step of vLLM's V1 runner (``KVConnectorModelRunnerMixin``, vLLM's code);
    ``defer``: with a speculative config (finalized after the drafter)."""
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    mixin = KVConnectorModelRunnerMixin
    so = _empty_output()
    with kv_agent(conn), set_forward_context({"layer": "metadata"}, conn._vllm_config):
        with mixin.maybe_get_kv_connector_output(so, defer_finalize=defer):
            pass  # the forward
        conn.calls.append(("draft", conn.has_connector_metadata()))
        if defer:
            mixin.finalize_kv_connector()
    return list(conn.calls)


def _deferred_reference() -> list[tuple[str, bool]]:
    """The order vLLM defers to with a speculator (0.33's V2 ``post_forward(...,
    defer_finalize=True)`` + ``finalize_step``, V1's ``finalize_kv_connector``): every
    result first, the draft model with the metadata bound, then the saves."""
    taken = [(name, True) for name in STEP_CALLS[2:7]]
    return [
        ("start_load_kv", True),
        *taken,
        ("draft", True),
        ("wait_for_save", True),
        ("clear_connector_metadata", True),
    ]


def test_the_speculator_order_defers_saves_past_the_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``V2SpecCallsOmniKVConnector`` on a runner without a speculator reaches
    OmniKVConnector in the order vLLM's runners use with one: vLLM's own deferred path
    (V1's, in every supported version; V2's where it has one) gives the same order."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    want = _deferred_reference()
    plain = _v1_step(_recording(monkeypatch, OmniKVConnector), defer=False)
    assert plain.index(("wait_for_save", True)) < plain.index(("get_transfer_results", True))
    assert _v1_step(_recording(monkeypatch, OmniKVConnector), defer=True) == want
    emulated = _recording(monkeypatch, V2SpecCallsOmniKVConnector)
    got = _v1_step(emulated, defer=False)  # the V1 runner without a speculator
    # the emulation runs the save at clear time: after the draft point of a plain step
    assert [c for c in got if c[0] != "draft"] == [c for c in want if c[0] != "draft"]
    if "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters:
        conn = _recording(monkeypatch, OmniKVConnector)  # vLLM >= 0.33: V2's own order
        for hook in ("register_kv_caches", "handle_preemptions"):
            monkeypatch.setattr(OmniKVConnector, hook, lambda self, arg: None)
        with kv_agent(conn):
            active = ActiveKVConnector(conn._vllm_config, {})
            active.pre_forward(_empty_output())
            active.finish_forward()
            active.post_forward(set(), defer_finalize=True)
            conn.calls.append(("draft", conn.has_connector_metadata()))
            active.finalize_step()
        assert conn.calls == want
