"""The connector's load path (``connector/receive.py``) over the fake backend: payload
checks, tail-only loads into vLLM's CPU layout, and heterogeneous TP merging.

Expected values come from ``reference_kv`` (explicit loops over the CPU block layout).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from _kv_fixtures import BS, LAYERS, cpu_layout_cache, head_shard, reference_kv

from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.metadata import LoadSpec
from vllm_omni_kv.connector.receive import Received, forward_mark, layer_caches, receive
from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.kvcache.device_order import DeviceEvent
from vllm_omni_kv.kvcache.kv_utils import KVTPTopology
from vllm_omni_kv.kvcache.paged_blocks import block_bytes, extract_request_blocks
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.testing import fake_backend
from vllm_omni_kv.testing.fake_backend import FakeBackend
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.transfer.session import TransferSession

SEQ = 300
SRC_IDS = [7, 2, 9, 0, 4, 11, 5, 1, 3, 8]
DST_IDS = [3, 4, 5, 6, 7, 8, 9, 10, 11, 0]
DIGEST = "abc123"
CPU_ENGINE = EngineLayout(BS, "LBHNC", "CPU_ATTN")


@pytest.fixture
def ns() -> Iterator[str]:
    name = uuid.uuid4().hex
    yield name
    leftover = fake_backend.live_keys(name)
    producer = _PRODUCERS.pop(name, None)
    if producer is not None:
        producer.backend.close()
    fake_backend.clear(name)
    assert not leftover, f"test left unconsumed payloads: {leftover}"


_PRODUCERS: dict[str, TransferSession] = {}


def _session(ns: str) -> TransferSession:
    return TransferSession(FakeBackend({"namespace": ns}), "prefill", "decode")


def _producer(ns: str) -> TransferSession:
    """One producer per test; it stays open (closing a backend withdraws its payloads)."""
    if ns not in _PRODUCERS:
        _PRODUCERS[ns] = _session(ns)
    return _PRODUCERS[ns]


def _spec(local: int = 0, digest: str = DIGEST, prompt: int = SEQ) -> LoadSpec:
    return LoadSpec(
        req_id="r",
        transfer_id="t",
        block_ids=DST_IDS,
        num_local_tokens=local,
        num_load_tokens=prompt - local,
        num_prompt_tokens=prompt,
        prompt_digest=digest,
    )


def _layers(caches: list[torch.Tensor]) -> list:
    return layer_caches({f"layer{i}": c for i, c in enumerate(caches)}, CPU_ENGINE)


def _send_blocks(ns: str, src: list[torch.Tensor], key: str = "k", **md: object) -> None:
    data = extract_request_blocks("t", SRC_IDS, SEQ, src, metadata={"prompt_digest": DIGEST, **md})
    _producer(ns).send(key, data, chunk_bytes=block_bytes(src[0], "cpu"))


def _check(dst: list[torch.Tensor], src: list[torch.Tensor], lo: int) -> None:
    for d, s in zip(dst, src, strict=True):
        want_k, want_v = reference_kv(s, SRC_IDS, SEQ)
        got_k, got_v = reference_kv(d, DST_IDS, SEQ)
        assert torch.equal(got_k[lo:], want_k[lo:]) and torch.equal(got_v[lo:], want_v[lo:])


def _receive(
    ns: str,
    dst: list[torch.Tensor],
    spec: LoadSpec,
    topo: KVTPTopology,
    keys: list[str],
    after: DeviceEvent | None = None,
) -> Received:
    return receive(
        _session(ns),
        _layers(dst),
        spec,
        [(k, None) for k in keys],
        topo,
        time.monotonic() + 5,
        threading.Event(),
        after=after,
    )


def test_tail_only_load_writes_just_the_missing_tokens(ns: str) -> None:
    src = [cpu_layout_cache(i, seed=0) for i in range(LAYERS)]
    dst = [cpu_layout_cache(i, seed=1) for i in range(LAYERS)]
    held = [d[DST_IDS[:4]].clone() for d in dst]
    _send_blocks(ns, src)
    got = _receive(ns, dst, _spec(local=4 * BS), KVTPTopology(1, 1, 0), ["k"])
    tokens, moved = got.tokens, got.moved
    assert tokens == SEQ - 4 * BS
    assert got.write_seconds > 0
    _check(dst, src, 4 * BS)
    for d, h in zip(dst, held, strict=True):
        assert torch.equal(d[DST_IDS[:4]], h)
    per_block = block_bytes(src[0], "cpu")
    assert moved < (len(SRC_IDS) - 4) * per_block * LAYERS + 16384


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (_spec(digest="other"), "different prompt"),
        (_spec(prompt=SEQ - 1), "tokens"),
    ],
)
def test_a_payload_for_another_request_is_refused(ns: str, spec: LoadSpec, match: str) -> None:
    src = [cpu_layout_cache(i) for i in range(LAYERS)]
    _send_blocks(ns, src)
    with pytest.raises(KVPayloadError, match=match):
        _receive(
            ns,
            [cpu_layout_cache(i, seed=1) for i in range(LAYERS)],
            spec,
            KVTPTopology(1, 1, 0),
            ["k"],
        )


def test_a_payload_cut_in_other_blocks_is_refused(ns: str) -> None:
    src = [cpu_layout_cache(i) for i in range(LAYERS)]
    data = extract_request_kv("t", SRC_IDS, SEQ, src, metadata={"prompt_digest": DIGEST})
    data.metadata["block_size"] = 16
    _producer(ns).send("k", data)
    with pytest.raises(KVPayloadError, match="blocks of 16"):
        _receive(
            ns,
            [cpu_layout_cache(i, seed=1) for i in range(LAYERS)],
            _spec(),
            KVTPTopology(1, 1, 0),
            ["k"],
        )


def test_two_source_shards_merge_into_one_consumer(ns: str) -> None:
    full = [cpu_layout_cache(i, seed=0) for i in range(LAYERS)]
    s = _producer(ns)
    for rank in range(2):  # producer TP 2 -> consumer TP 1: token-major head shards
        shard = [head_shard(c, rank, 2) for c in full]
        data = extract_request_kv("t", SRC_IDS, SEQ, shard, metadata={"prompt_digest": DIGEST})
        s.send(f"k{rank}", data)
    dst = [cpu_layout_cache(i, seed=1) for i in range(LAYERS)]
    tokens = _receive(ns, dst, _spec(local=2 * BS), KVTPTopology(2, 1, 0), ["k0", "k1"]).tokens
    assert tokens == SEQ - 2 * BS
    _check(dst, full, 2 * BS)


def test_an_unreadable_cache_layout_fails_at_registration() -> None:
    with pytest.raises(ConfigError, match="4-D per-layer KV cache"):
        layer_caches({"l0": torch.zeros(3, 3)}, CPU_ENGINE)
    # an LBNHC-strided view registered by an engine that says LBHNC
    lbnhc = torch.zeros(8, BS, 2, 128).transpose(1, 2)
    with pytest.raises(ConfigError, match="not in LBHNC order"):
        layer_caches({"l0": lbnhc}, EngineLayout(BS, "LBHNC", "FLASH_ATTN"))


# -- order against the forward stream (issue 24, item 6) ----------------------------------
def test_a_loads_writes_run_after_the_work_queued_when_it_started(ns: str) -> None:
    """Work queued on the forward stream before the load started (a step still running
    under async scheduling, writing a block that is then freed and handed to this load)
    runs before the load's writes, and the load returns only once they ran."""
    src = [cpu_layout_cache(i, seed=0) for i in range(LAYERS)]
    dst = [cpu_layout_cache(i, seed=1) for i in range(LAYERS)]
    _send_blocks(ns, src)
    fake = RecordingStreams()
    with device_order.installed("cpu", fake):
        stale = fake.work(fake.forward, "the previous step's write into a block")
        after = forward_mark(_layers(dst))
        got = _receive(ns, dst, _spec(), KVTPTopology(1, 1, 0), ["k"], after=after)
    assert got.tokens == SEQ
    _check(dst, src, 0)
    (side,) = fake.side_streams()
    assert side.ops[0][0] == "wait", "the load queued work before waiting for the forward"
    assert fake.before(stale, (side.name, 0))
    assert fake.waited_for((side.name, len(side.ops) - 1)), "reported before its writes ran"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_load_lands_after_a_write_queued_on_the_forward(ns: str) -> None:
    """A write into the request's blocks queued on the (busy) forward stream before the
    load started is overwritten by the load, not the other way round."""
    src = [cpu_layout_cache(i, seed=0) for i in range(LAYERS)]
    dst = [cpu_layout_cache(i, seed=1).to("cuda") for i in range(LAYERS)]
    _send_blocks(ns, src)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the previous step still running
    for d in dst:
        d.fill_(7)  # ... and then writing into the blocks
    after = forward_mark(_layers(dst))
    got = _receive(ns, dst, _spec(), KVTPTopology(1, 1, 0), ["k"], after=after)
    torch.cuda.synchronize()
    assert got.tokens == SEQ
    _check([d.cpu() for d in dst], src, 0)
