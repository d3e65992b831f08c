"""Layer-wise parts: splitting, reassembly, validation, and streaming receive across processes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _kv_fixtures import LAYERS, cpu_layout_cache, reference_kv
from _mp import CTX

from vllm_omni_kv import KVCacheTransferData, OmniKVTransferManager
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferTimeout
from vllm_omni_kv.kvcache.kv_utils import get_kv_connector_key
from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks
from vllm_omni_kv.transfer.kv_config import OmniKVCacheConfig
from vllm_omni_kv.transfer.parts import (
    iter_parts,
    join_parts,
    part_info,
    part_key,
    split_payload,
)
from vllm_omni_kv.wire import codec

BLOCKS = [7, 2, 9, 4, 0, 11]
SEQ = 150


def _payload(n_layers: int = 5, rows: int = 4) -> KVCacheTransferData:
    keys = [torch.full((rows, 2, 8), float(i)) for i in range(n_layers)]
    values = [torch.full((rows, 2, 8), float(-i)) for i in range(n_layers)]
    keys[2] = None  # a skipped layer still counts as a layer
    values[2] = None
    return KVCacheTransferData(
        "req_1", {"key_cache": keys, "value_cache": values}, [3, 4], {"m": 1}
    )


def _roundtrip(part: KVCacheTransferData) -> dict:
    return KVCacheTransferData.from_bytes(part.to_bytes())


# -- splitting and joining ------------------------------------------------------------------------


def test_split_groups_layers_without_copying() -> None:
    data = _payload()
    layer = 2 * 4 * 2 * 8 * 4  # K+V bytes of one layer
    parts = split_payload(data, 2 * layer)
    # layer 2 is skipped (no bytes), so it rides along with layers 0 and 1
    assert [p.metadata["layer_start"] for p in parts] == [0, 3]
    assert all(p.metadata["num_parts"] == 2 for p in parts)
    assert [p.metadata["part_index"] for p in parts] == [0, 1]
    assert parts[0].block_ids == [3, 4] and parts[1].block_ids == []
    assert parts[0].layer_blocks["key_cache"][2] is None
    assert parts[1].layer_blocks["key_cache"][1] is data.layer_blocks["key_cache"][4]
    assert parts[0].metadata["m"] == 1


def test_split_keeps_small_or_unsplittable_payloads_whole() -> None:
    data = _payload()
    assert split_payload(data, 0) == [data]
    assert split_payload(data, 1 << 30) == [data]
    odd = KVCacheTransferData("r", {"kv": torch.zeros(4)}, [], {})
    assert split_payload(odd, 1) == [odd]
    # a layer larger than the limit is a part of its own
    assert len(split_payload(data, 1)) == 5


def test_join_restores_the_payload_through_frames() -> None:
    data = _payload()
    parts = [_roundtrip(p) for p in split_payload(data, 1)]
    joined = join_parts(parts)
    assert joined["request_id"] == "req_1" and joined["block_ids"] == [3, 4]
    assert joined["metadata"] == {"m": 1}
    for name in ("key_cache", "value_cache"):
        for got, want in zip(joined["layer_blocks"][name], data.layer_blocks[name], strict=True):
            assert (got is None and want is None) or torch.equal(got, want)
    whole = data.to_dict()
    assert join_parts([whole]) is whole


def test_join_rejects_parts_that_do_not_fit() -> None:
    parts = [_roundtrip(p) for p in split_payload(_payload(), 1)]
    with pytest.raises(KVPayloadError, match="part 0 of 4"):
        join_parts(parts[:4])
    with pytest.raises(KVPayloadError, match="part 0 of 5"):
        join_parts([parts[1], parts[0], *parts[2:]])
    other = dict(parts[3], request_id="req_2")
    with pytest.raises(KVPayloadError, match="belongs to request"):
        join_parts([*parts[:3], other, parts[4]])
    shifted = dict(parts[2], metadata={**parts[2]["metadata"], "layer_start": 3})
    with pytest.raises(KVPayloadError, match="starts at layer 3, expected 2"):
        join_parts([*parts[:2], shifted, *parts[3:]])


@pytest.mark.parametrize(
    "meta",
    [
        {"part_index": "0", "num_parts": 2, "layer_start": 0},
        {"part_index": 0, "num_parts": 0, "layer_start": 0},
        {"part_index": 2, "num_parts": 2, "layer_start": 0},
        {"part_index": 0, "num_parts": 10**6, "layer_start": 0},
        {"part_index": 0, "num_parts": 2, "layer_start": -1},
        {"part_index": 0, "num_parts": 2},
    ],
)
def test_part_metadata_is_validated(meta: dict) -> None:
    with pytest.raises(KVPayloadError):
        part_info({"metadata": meta})


def test_part_keys() -> None:
    assert part_key("k", 0) == "k"
    assert part_key("k", 3) == "k.part3"


def test_iter_parts_reports_a_missing_later_part() -> None:
    parts = {
        part_key("k", i): (_roundtrip(p), 1) for i, p in enumerate(split_payload(_payload(), 1))
    }
    del parts[part_key("k", 3)]
    got = []
    with pytest.raises(KVTransferTimeout, match="received 3 of 5 parts"):
        for part, _ in iter_parts(lambda key, first: parts.get(key), "k"):
            got.append(part)
    assert len(got) == 3
    assert list(iter_parts(lambda key, first: None, "k")) == []
    swapped = {"k": parts[part_key("k", 1)]}
    with pytest.raises(KVPayloadError, match="holds part 1 instead of part 0"):
        list(iter_parts(lambda key, first: swapped.get(key), "k"))


def test_config_validates_part_settings() -> None:
    for bad in (-1, True, "8M"):
        with pytest.raises(ConfigError, match="max_part_bytes"):
            OmniKVCacheConfig(max_part_bytes=bad)  # type: ignore[arg-type]
    assert OmniKVCacheConfig().max_part_bytes is None  # automatic
    with pytest.raises(ConfigError, match="poll_interval"):
        OmniKVCacheConfig(poll_interval=0)


@pytest.mark.parametrize("stream,expected_puts", [(True, 1), (False, LAYERS)])
def test_unset_max_part_bytes_sends_one_frame_only_to_streaming_backends(
    ns: str, stream: bool, expected_puts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Automatic parts: one streamed frame over shm, layer parts over a non-streaming backend."""
    monkeypatch.setattr("vllm_omni_kv.transfer.session.DEFAULT_MAX_PART_BYTES", 1)
    cfg = OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": ns, "stream": stream},
        from_stage="prefill",
        to_stage="decode",
        need_send_cache=True,
    )
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    data = extract_request_blocks("req_a", BLOCKS, SEQ, caches)
    with OmniKVTransferManager(cfg) as mgr:
        assert mgr.connector.supports_streaming is stream
        assert mgr.send_kv_cache("req_a", data)
        assert mgr.connector.health()["puts"] == expected_puts


# -- across processes, through the shared-memory backend --------------------------------------------


def _cfg(ns: str, *, send: bool, part_bytes: int, timeout: float = 20.0) -> OmniKVCacheConfig:
    return OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": ns},
        from_stage="prefill",
        to_stage="decode",
        need_send_cache=send,
        need_recv_cache=not send,
        recv_timeout=timeout,
        max_part_bytes=part_bytes,
    )


@pytest.fixture
def ns(request) -> str:
    return f"parts{os.getpid()}_{request.node.name[:30]}"


def _send(ns: str, fmt: str, part_bytes: int, only_parts: int, done) -> None:
    mgr = OmniKVTransferManager(_cfg(ns, send=True, part_bytes=part_bytes))
    caches = [cpu_layout_cache(i) for i in range(LAYERS)]
    if fmt == "blocks":
        data = extract_request_blocks("req_a", BLOCKS, SEQ, caches)
    else:
        data = mgr.extract_kv_cache("req_a", BLOCKS, SEQ, caches, 32, "auto", lazy=True)
    if only_parts:  # a sender that stalls mid-payload: publish the first parts only
        key = get_kv_connector_key("req_a", "prefill", 0, 0, 0)
        for i, part in enumerate(split_payload(data, part_bytes)[:only_parts]):
            mgr.connector.put("prefill", "decode", part_key(key, i), part)
    else:
        assert mgr.send_kv_cache("req_a", data)
    done.wait(60)
    mgr.close()


def _start_sender(ns: str, fmt: str, part_bytes: int, only_parts: int = 0):
    done = CTX.Event()
    proc = CTX.Process(target=_send, args=(ns, fmt, part_bytes, only_parts, done))
    proc.start()
    return proc, done


def _stop(proc, done) -> None:
    done.set()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


@pytest.mark.parametrize("fmt", ["blocks", "tokens"])
def test_receive_into_a_paged_cache_part_by_part(ns: str, fmt: str) -> None:
    """Each layer arrives as its own part and lands in the consumer's own blocks bit-exactly."""
    proc, done = _start_sender(ns, fmt, part_bytes=1)
    local_ids = [1, 5, 3, 8, 10]  # the consumer's blocks: other ids than the producer's
    caches = [torch.zeros_like(cpu_layout_cache(i)) for i in range(LAYERS)]
    try:
        mgr = OmniKVTransferManager(_cfg(ns, send=False, part_bytes=1))
        got = mgr.receive_kv_cache_into("req_a", list(caches), local_ids)
        mgr.close()
    finally:
        _stop(proc, done)
    assert got is not None
    tokens, size = got
    assert tokens == SEQ and size > 0
    for i in range(LAYERS):
        k_ref, v_ref = reference_kv(cpu_layout_cache(i), BLOCKS, SEQ)
        k, v = reference_kv(caches[i], local_ids, SEQ)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_parts_are_published_under_their_own_keys(ns: str) -> None:
    proc, done = _start_sender(ns, "blocks", part_bytes=1)
    rx = SharedMemoryConnector({"namespace": ns})
    key = get_kv_connector_key("req_a", "prefill", 0, 0, 0)
    try:
        deadline = time.monotonic() + 20
        seen = []
        for i in range(LAYERS):
            while (got := rx.get("prefill", "decode", part_key(key, i))) is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            seen.append(part_info(got[0]))
            del got
    finally:
        rx.close()
        _stop(proc, done)
    assert seen == [(i, LAYERS, i) for i in range(LAYERS)]


def test_sender_stalling_mid_payload_times_out_cleanly(ns: str) -> None:
    proc, done = _start_sender(ns, "blocks", part_bytes=1, only_parts=2)
    caches = [torch.zeros_like(cpu_layout_cache(i)) for i in range(LAYERS)]
    try:
        mgr = OmniKVTransferManager(_cfg(ns, send=False, part_bytes=1, timeout=1.5))
        t0 = time.monotonic()
        assert mgr.receive_kv_cache_into("req_a", list(caches), BLOCKS) is None
        assert mgr.receive_kv_cache_for_request("req_a") == (None, 0)
        assert time.monotonic() - t0 < 10
        mgr.close()
    finally:
        _stop(proc, done)


def test_receive_into_needs_a_homogeneous_topology(ns: str) -> None:
    cfg = _cfg(ns, send=False, part_bytes=1)
    cfg.from_tp = 2
    mgr = OmniKVTransferManager(cfg)
    with pytest.raises(ConfigError, match="heterogeneous TP"):
        mgr.receive_kv_cache_into("req_a", [], [])
    mgr.close()


def test_frames_of_parts_are_individually_checksummed() -> None:
    part = split_payload(_payload(), 1)[1]
    buf = part.to_bytes()
    buf[-1] ^= 0xFF
    with pytest.raises(KVPayloadError, match="checksum mismatch"):
        codec.decode(buf)
