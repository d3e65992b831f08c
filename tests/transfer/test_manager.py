"""OmniKVTransferManager: the RFC's unit tests, AR -> diffusion across processes, heterogeneous TP."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
from _kv_fixtures import BS, HEADS, LAYERS, cpu_layout_cache, head_shard, reference_kv
from _mp import CTX

from vllm_omni_kv import (
    BackendUnavailable,
    ConfigError,
    KVTransferError,
    OmniConnectorFactory,
    OmniKVTransferManager,
    SharedMemoryConnector,
)
from vllm_omni_kv.transfer.manager import OmniKVCacheConfig

BLOCKS = [7, 2, 9, 4, 0, 11]
SEQ = 150  # 4 full blocks of 32 + a partial one


def _omni_cfg(
    ns: str,
    *,
    send: bool,
    from_tp: int = 1,
    to_tp: int = 1,
    rank: int = 0,
    timeout: float = 20.0,
    **kw,
):
    kv = {
        "connector_config": {"type": "SharedMemoryConnector", "namespace": ns},
        "omni_from_stage": "0",
        "omni_to_stage": "1",
        "stage_id": "0" if send else "1",
        "engine_input_source": [] if send else ["0"],
        "need_send_cache": send,
        "need_recv_cache": not send,
        "recv_timeout": timeout,
        "rank_mapping": {"from_tp": from_tp, "to_tp": to_tp},
        "local_rank": rank,
        **kw,
    }
    return SimpleNamespace(omni_kv_config=kv, stage_id=kv["stage_id"])


@pytest.fixture
def ns(request) -> str:
    return f"m{os.getpid()}_{request.node.name[:40]}"


# -- RFC unit tests ----------------------------------------------------------------------


def test_connector_lazy_init(ns):
    mgr = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=True))
    assert mgr._connector is None
    conn = mgr.connector
    assert isinstance(conn, SharedMemoryConnector)
    assert mgr.connector is conn and mgr.get_connector is conn
    mgr.close()
    mgr.close()


def test_extract_kv_cache(ns):
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    mgr = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=True))
    data = mgr.extract_kv_cache("r", BLOCKS, SEQ, caches, BS, "auto")
    for i, cache in enumerate(caches):
        k_ref, v_ref = reference_kv(cache, BLOCKS, SEQ)
        assert torch.equal(data.layer_blocks["key_cache"][i], k_ref)
        assert torch.equal(data.layer_blocks["value_cache"][i], v_ref)
    assert data.metadata["seq_len"] == SEQ and data.metadata["block_size"] == BS
    assert mgr._connector is None  # extraction alone does not start a connector


class _Flaky(SharedMemoryConnector):
    """A real shared-memory connector whose first N puts fail (a fault we cannot cause for real)."""

    failures: dict[str, int] = {}

    def put(self, from_stage, to_stage, put_key, data):
        left = _Flaky.failures.get(self.namespace, 0)
        if left > 0:
            _Flaky.failures[self.namespace] = left - 1
            raise KVTransferError("injected transient failure")
        return super().put(from_stage, to_stage, put_key, data)


@pytest.mark.parametrize(
    ("failures", "retries", "expect"), [(2, 3, True), (3, 3, False), (0, 1, True)]
)
def test_send_with_retry(ns, failures, retries, expect):
    OmniConnectorFactory.register_connector("FlakyShm", _Flaky)
    _Flaky.failures[ns] = failures
    cfg = _omni_cfg(ns, send=True)
    cfg.omni_kv_config["connector_config"] = {"type": "FlakyShm", "namespace": ns}
    mgr = OmniKVTransferManager.from_od_config(cfg)
    mgr.config.send_retries = retries
    mgr.config.retry_backoff = 0.001
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    sent = mgr.handle_finished_requests_kv_transfer(
        {"r": {"block_ids": BLOCKS, "seq_len": SEQ}}, caches, BS, "auto"
    )
    assert sent == (["r"] if expect else [])
    mgr.close()


def test_receive_timeout(ns):
    mgr = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=False, timeout=0.5))
    t0 = time.monotonic()
    data, size = mgr.receive_kv_cache_for_request("nobody-sends-this")
    elapsed = time.monotonic() - t0
    assert data is None and size == 0
    assert 0.5 <= elapsed < 2.0
    req = SimpleNamespace(request_id="nobody")
    assert mgr.receive_kv_cache(req) is False and not hasattr(req, "past_key_values")
    mgr.close()


def test_handle_finished_reports_only_really_sent(ns):
    mgr = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=True))
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    finished = {
        "good": {"block_ids": BLOCKS, "seq_len": SEQ},
        "bad-block": {"block_ids": [99], "seq_len": 10},  # block id out of range
        "too-long": {"block_ids": [1], "seq_len": 500},  # not enough blocks
        "malformed": {"seq_len": 3},
    }
    assert mgr.handle_finished_requests_kv_transfer(finished, caches, BS, "auto") == ["good"]
    mgr.close()


def test_connector_start_failure_is_surfaced_and_logged_once(ns, caplog):
    cfg = _omni_cfg(ns, send=True)
    cfg.omni_kv_config["connector_config"] = {
        "type": "SharedMemoryConnector",
        "ttl_seconds": "soon",
    }
    mgr = OmniKVTransferManager.from_od_config(cfg)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(ConfigError, match="bad numeric"):
            _ = mgr.connector
        with pytest.raises(BackendUnavailable, match="failed to start earlier"):
            _ = mgr.connector
    assert isinstance(mgr.connector_error, ConfigError)
    assert sum("failed to start" in r.getMessage() for r in caplog.records) == 1
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    assert (
        mgr.handle_finished_requests_kv_transfer(
            {"r": {"block_ids": BLOCKS, "seq_len": SEQ}}, caches, BS, "auto"
        )
        == []
    )


def test_unknown_backend_names_the_choices(ns):
    cfg = _omni_cfg(ns, send=True)
    cfg.omni_kv_config["connector_config"] = {"type": "NoSuchThing"}
    with pytest.raises(
        ConfigError, match="unknown omni connector 'NoSuchThing'.*SharedMemoryConnector"
    ):
        _ = OmniKVTransferManager.from_od_config(cfg).connector


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="recv_timeout"):
        OmniKVCacheConfig(recv_timeout=-1)
    with pytest.raises(ConfigError, match="from_tp"):
        OmniKVTransferManager.from_od_config(
            SimpleNamespace(omni_kv_config={"rank_mapping": {"from_tp": 0}})
        )


def test_from_vllm_config_falls_back_to_kv_transfer_config(ns):
    ktc = SimpleNamespace(
        kv_role="kv_consumer",
        kv_connector_extra_config={
            "omni_connector_config": {"type": "SharedMemoryConnector", "namespace": ns},
            "omni_from_stage": "ar",
            "engine_input_source": ["ar"],
            "stage_id": "dit",
            "recv_timeout": 3,
        },
    )
    mgr = OmniKVTransferManager.from_vllm_config(
        SimpleNamespace(kv_transfer_config=ktc), SimpleNamespace()
    )
    assert mgr.config.need_recv_cache and not mgr.config.need_send_cache
    assert mgr.recv_stages == ("ar", "dit") and mgr.config.recv_timeout == 3
    # model_config.omni_kv_config wins when present
    mgr2 = OmniKVTransferManager.from_vllm_config(
        SimpleNamespace(kv_transfer_config=ktc), _omni_cfg(ns, send=True)
    )
    assert mgr2.send_stages == ("0", "1")


def test_update_sender_info_offsets_port_per_rank(ns):
    mgr = OmniKVTransferManager.from_od_config(
        _omni_cfg(ns, send=False, from_tp=2, to_tp=2, rank=1)
    )
    mgr.update_sender_info({"1": {"host": "10.0.0.5", "zmq_port": 50100}}, sender_stage_id=1)
    assert mgr._endpoint(1) == {"source_host": "10.0.0.5", "source_port": 50116}
    assert mgr._endpoint(None) is None
    with pytest.raises(ConfigError, match="zmq_port"):
        mgr.update_sender_info({"host": "h"})


# -- across processes --------------------------------------------------------------------


def _producer(ns, rank, from_tp, to_tp, req_ids, heads_total, ready, done, part_bytes):
    mgr = OmniKVTransferManager.from_od_config(
        _omni_cfg(ns, send=True, from_tp=from_tp, to_tp=to_tp, rank=rank, max_part_bytes=part_bytes)
    )
    caches = [
        head_shard(cpu_layout_cache(i, heads=heads_total), rank, from_tp) for i in range(LAYERS)
    ]
    finished = {r: {"block_ids": BLOCKS, "seq_len": SEQ} for r in req_ids}
    sent = mgr.handle_finished_requests_kv_transfer(finished, caches, BS, "auto")
    ready.put(sent)
    done.wait(120)  # keep the arena alive until consumers are done
    mgr.close()


def _consumer(ns, rank, from_tp, to_tp, req_id, heads_total, out):
    try:
        mgr = OmniKVTransferManager.from_od_config(
            _omni_cfg(ns, send=False, from_tp=from_tp, to_tp=to_tp, rank=rank)
        )
        data, size = mgr.receive_kv_cache_for_request(req_id)
        if data is None:
            out.put((rank, "timeout"))
            return
        per = heads_total // to_tp
        ok = True
        for i in range(LAYERS):
            k_ref, v_ref = reference_kv(cpu_layout_cache(i, heads=heads_total), BLOCKS, SEQ)
            k_ref, v_ref = (
                k_ref[:, rank * per : (rank + 1) * per],
                v_ref[:, rank * per : (rank + 1) * per],
            )
            k, v = data["layer_blocks"]["key_cache"][i], data["layer_blocks"]["value_cache"][i]
            ok &= k.shape == k_ref.shape and torch.equal(k, k_ref) and torch.equal(v, v_ref)
        out.put((rank, "ok" if ok else f"mismatch shape={tuple(k.shape)} size={size}"))
        del data
        mgr.close()
    except Exception as e:
        out.put((rank, f"error {e!r}"))


def _run_topology(ns, from_tp, to_tp, heads_total=HEADS, req="req_x", part_bytes=8 << 20):
    ready, out, done = CTX.Queue(), CTX.Queue(), CTX.Event()
    procs = [
        CTX.Process(
            target=_producer,
            args=(ns, r, from_tp, to_tp, [req], heads_total, ready, done, part_bytes),
        )
        for r in range(from_tp)
    ]
    procs += [
        CTX.Process(target=_consumer, args=(ns, r, from_tp, to_tp, req, heads_total, out))
        for r in range(to_tp)
    ]
    for p in procs:
        p.start()
    try:
        sent = [ready.get(timeout=120) for _ in range(from_tp)]
        results = dict(out.get(timeout=120) for _ in range(to_tp))
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert sent == [[req]] * from_tp
    assert results == {r: "ok" for r in range(to_tp)}


@pytest.mark.slow
def test_ar_to_diffusion_transfer(ns):
    """A producer extracts from paged blocks; a separate consumer gets bit-identical [seq, heads, dim]."""
    _run_topology(ns, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize(("from_tp", "to_tp"), [(2, 1), (1, 2), (4, 2)])
def test_heterogeneous_tp(ns, from_tp, to_tp):
    _run_topology(ns, from_tp, to_tp, heads_total=8)


@pytest.mark.slow
@pytest.mark.parametrize(("from_tp", "to_tp"), [(1, 1), (2, 1), (1, 2)])
def test_layer_parts_across_processes(ns, from_tp, to_tp):
    """One part per layer (max_part_bytes=1): receivers reassemble bit-identical KV, TP included."""
    _run_topology(ns, from_tp, to_tp, heads_total=8, part_bytes=1)


def test_receive_multi_kv_cache_with_cfg_companions(ns):
    prod = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=True))
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    neg = [cpu_layout_cache(i, seed=5) for i in range(LAYERS)]
    assert prod.handle_finished_requests_kv_transfer(
        {"p": {"block_ids": BLOCKS, "seq_len": SEQ}}, caches, BS, "auto"
    )
    assert prod.handle_finished_requests_kv_transfer(
        {"p-neg": {"block_ids": BLOCKS, "seq_len": 40}}, neg, BS, "auto"
    )
    cons = OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=False, timeout=5))

    def collect(request_id, cfg_ids, manager, device):
        return {
            "cfg_kv_caches": {
                i: manager.receive_kv_cache_for_request(i, device)[0] for i in cfg_ids
            }
        }

    req = SimpleNamespace(
        request_id="p", sampling_params=SimpleNamespace(cfg_kv_request_ids=["p-neg"])
    )
    assert cons.receive_multi_kv_cache(req, collect)
    k_ref, _ = reference_kv(caches[0], BLOCKS, SEQ)
    assert torch.equal(req.past_key_values.key_cache[0], k_ref)
    assert torch.equal(req.sampling_params.past_key_values.key_cache[0], k_ref)
    neg_kv = req.sampling_params.cfg_kv_caches["p-neg"]
    assert torch.equal(neg_kv["layer_blocks"]["key_cache"][2], reference_kv(neg[2], BLOCKS, 40)[0])
    assert req.kv_metadata["seq_len"] == SEQ
    prod.close()
    cons.close()


# -- torch.distributed (gloo) ----------------------------------------------------------------


def _dist_worker(ns, rank, world, tp, port, out):
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        tp_rank = rank % tp
        mgr = OmniKVTransferManager.from_od_config(
            _omni_cfg(ns, send=False, from_tp=tp, to_tp=tp, rank=tp_rank, timeout=30)
        )

        def collect(request_id, cfg_ids, manager, device):
            return {
                "neg_seq": [
                    int(manager.receive_kv_cache_for_request(i)[0]["metadata"]["seq_len"])
                    for i in cfg_ids
                ]
            }

        req = SimpleNamespace(
            request_id="d", sampling_params=SimpleNamespace(cfg_kv_request_ids=["d-neg"])
        )
        ok = mgr.receive_multi_kv_cache_distributed(req, collect, tp_size=tp)
        per = 8 // tp
        k_ref, _ = reference_kv(cpu_layout_cache(1, heads=8), BLOCKS, SEQ)
        k = req.past_key_values.key_cache[1] if ok else None
        good = ok and torch.equal(k, k_ref[:, tp_rank * per : (tp_rank + 1) * per])
        out.put((rank, good, getattr(req.sampling_params, "neg_seq", None)))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        mgr.close()
    except Exception as e:
        out.put((rank, f"error {e!r}", None))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "tp"), [(2, 1), (2, 2), (4, 2)], ids=["tp-inactive", "tp-only", "tp-and-cfg"]
)
def test_receive_multi_kv_cache_distributed(ns, world, tp):
    from vllm_omni_kv.testing.net import free_port

    # The producer (this process) publishes exactly one key per receiving TP rank.
    producers = [
        OmniKVTransferManager.from_od_config(_omni_cfg(ns, send=True, from_tp=tp, to_tp=tp, rank=r))
        for r in range(tp)
    ]
    for r, prod in enumerate(producers):
        caches = [head_shard(cpu_layout_cache(i, heads=8), r, tp) for i in range(LAYERS)]
        assert prod.handle_finished_requests_kv_transfer(
            {"d": {"block_ids": BLOCKS, "seq_len": SEQ}}, caches, BS, "auto"
        )
        assert prod.handle_finished_requests_kv_transfer(
            {"d-neg": {"block_ids": BLOCKS, "seq_len": 33}}, caches, BS, "auto"
        )
    out, port = CTX.Queue(), free_port()
    procs = [
        CTX.Process(target=_dist_worker, args=(ns, r, world, tp, port, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=180) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for prod in producers:
            prod.close()
    assert results == [(r, True, [33]) for r in range(world)]
