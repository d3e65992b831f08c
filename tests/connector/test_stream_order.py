"""The real connector's order against the forward stream (issue 24, items 6 and 7), driven
the way vLLM 0.32's V1 model runner drives it, with recording streams installed for the
host: the CPU caches then take the stream paths a CUDA cache takes, and the order the
connector asked for is checked (:mod:`vllm_omni_kv.testing.fake_streams`).

* A consumer's load writes only after the work queued on the forward stream when
  ``start_load_kv`` ran (a step still in flight under async scheduling).
* A producer exporting its cache waits for the forward once per step, not once per payload.
"""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm")

from test_runner_sequences import (  # noqa: E402
    DECODING,
    SEQ,
    SRC_IDS,
    Runner,
    Side,
    _assert_same_kv,
    _load_outcome,
    _request,
    _save_spec,
    _sched_out,
    _schedule_load,
)

from vllm_omni_kv.kvcache import device_order  # noqa: E402
from vllm_omni_kv.testing.fake_streams import RecordingStreams  # noqa: E402


@pytest.fixture
def ns() -> str:
    return f"pytest-order-{uuid.uuid4().hex[:10]}"


def test_loads_write_after_the_forward_work_queued_when_they_started(ns: str) -> None:
    prod, cons = Side("kv_producer", ns, seed=0), Side("kv_consumer", ns, seed=1)
    fake = RecordingStreams()
    try:
        with device_order.installed("cpu", fake):
            runner = Runner("v1", cons)
            save_so, params = _save_spec(prod, "r1")
            prod.worker.register_kv_caches(prod.caches)
            prod.worker.bind_connector_metadata(save_so.kv_connector_metadata)
            prod.worker.wait_for_save()
            prod.worker.clear_connector_metadata()
            req = _schedule_load(cons, "r1", params)
            stale = fake.work(fake.forward, "the step in flight, writing a freed block")
            done: set[str] = set()
            deadline = time.monotonic() + 10
            while "r1" not in done and time.monotonic() < deadline:
                out, _took = runner.step(cons.step(_sched_out(DECODING)))
                if out is not None:
                    cons.sched.update_connector_output(out)
                    done |= out.finished_recving or set()
        assert "r1" in done, "the load never finished"
        assert _load_outcome(cons, req)["ok"]
        _assert_same_kv(cons, prod)
        loads = [s for s in fake.side_streams() if s.ops]
        assert loads, "the load queued nothing on a stream of its own"
        for side in loads:
            assert side.ops[0][0] == "wait", f"{side.name} wrote before waiting for the forward"
            assert fake.before(stale, (side.name, 0)), f"{side.name} may write before it"
            assert fake.waited_for((side.name, len(side.ops) - 1)), "reported before it ran"
    finally:
        cons.close()
        prod.close()


def test_an_exporting_producer_waits_for_the_forward_once_per_step(ns: str) -> None:
    prod = Side("kv_producer", ns, seed=0, share_cache=True)
    fake = RecordingStreams()
    try:
        with device_order.installed("cpu", fake):
            prod.worker.register_kv_caches(prod.caches)
            for rid in ("r1", "r2", "r3"):
                prod.sched.on_new_request(_request(rid, {"do_remote_decode": True}))
            forward = fake.work(fake.forward, "the forward that wrote the prompts' pages")
            so = prod.step(
                _sched_out(
                    {r: SEQ for r in ("r1", "r2", "r3")},
                    blocks=dict.fromkeys(("r1", "r2", "r3"), SRC_IDS),
                )
            )
            assert len(so.kv_connector_metadata.saves) == 3
            prod.worker.bind_connector_metadata(so.kv_connector_metadata)
            prod.worker.wait_for_save()
            prod.worker.clear_connector_metadata()
        assert prod.worker.worker_half.session.held_payloads()[0] == 3
        waits = [w for w in fake.host_waits if w[0] == fake.forward.name]
        assert len(waits) == 1, f"{len(waits)} waits for the forward in one step"
        assert fake.waited_for(forward), "payloads were published before the forward ran"
    finally:
        prod.close()
