"""``TransferSession`` over the in-process fake backend: keys, the rank -> port rule,
send retries, parts, ranged (tail-only) receives, timeouts, cancel and discard.

Expected K/V values come from ``reference_kv`` (explicit per-token loops over vLLM's
CPU block layout), never from the code under test.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from _kv_fixtures import BS, LAYERS, cpu_layout_cache, reference_kv

from vllm_omni_kv.backends.pull.side_channel import sender_zmq_port
from vllm_omni_kv.errors import (
    KVPayloadError,
    KVTransferCancelled,
    KVTransferError,
    KVTransferTimeout,
)
from vllm_omni_kv.kvcache.formats import plan_injection
from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, get_kv_connector_key
from vllm_omni_kv.kvcache.paged_blocks import block_bytes, extract_request_blocks
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.testing import fake_backend
from vllm_omni_kv.testing.fake_backend import FakeBackend
from vllm_omni_kv.transfer.parts import part_layer_count
from vllm_omni_kv.transfer.session import SessionPolicy, TransferSession, sender_endpoint

SEQ = 300  # 10 blocks of 32, the last one partly used
SRC_IDS = [7, 2, 9, 0, 4, 11, 5, 1, 3, 8]
DST_IDS = [3, 4, 5, 6, 7, 8, 9, 10, 11, 0]


@pytest.fixture
def ns() -> Iterator[str]:
    name = uuid.uuid4().hex
    yield name
    leftover = fake_backend.live_keys(name)
    fake_backend.clear(name)
    assert not leftover, f"test left unconsumed payloads: {leftover}"


def _pair(
    ns: str, policy: SessionPolicy | None = None, **knobs: object
) -> tuple[TransferSession, TransferSession]:
    tx = TransferSession(FakeBackend({"namespace": ns, **knobs}), "prefill", "decode", policy)
    rx = TransferSession(FakeBackend({"namespace": ns}), "prefill", "decode", policy)
    return tx, rx


def _caches(seed: int = 0) -> list[torch.Tensor]:
    return [cpu_layout_cache(i, seed=seed) for i in range(LAYERS)]


def _blocks_payload(caches: list[torch.Tensor]) -> tuple[object, int]:
    data = extract_request_blocks("req", SRC_IDS, SEQ, caches)
    return data, block_bytes(caches[0], "cpu")


def _receive(
    rx: TransferSession, dst: list[torch.Tensor], start: int = 0, timeout: float = 5.0
) -> tuple[int, int]:
    def plan(part: dict, layer_start: int) -> object:
        local = dst[layer_start : layer_start + part_layer_count(part)]
        return plan_injection(part, local, DST_IDS, start_token=start)

    return rx.receive_into("k", None, time.monotonic() + timeout, plan)  # type: ignore[arg-type]


def _assert_tokens(dst: list[torch.Tensor], src: list[torch.Tensor], lo: int, hi: int) -> None:
    for d, s in zip(dst, src, strict=True):
        want_k, want_v = reference_kv(s, SRC_IDS, SEQ)
        got_k, got_v = reference_kv(d, DST_IDS, SEQ)
        assert torch.equal(got_k[lo:hi], want_k[lo:hi])
        assert torch.equal(got_v[lo:hi], want_v[lo:hi])


# -- keys and endpoints -----------------------------------------------------------------


def test_keys_follow_kv_utils_and_pair_up() -> None:
    s = TransferSession(FakeBackend({"namespace": "keys"}), "prefill", "decode")
    topo_tx = KVTPTopology(2, 1, 1)  # sender rank 1 of 2 feeding one receiver
    topo_rx = KVTPTopology(2, 1, 0)
    sent = s.send_keys("r", topo_tx)
    assert sent == [get_kv_connector_key("r", "prefill", 0, 1, 0)]
    assert [k for k, _rank in s.recv_keys("r", topo_rx)][1] == sent[0]
    s.backend.close()


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_one_rank_to_port_rule_for_senders_and_receivers(rank: int) -> None:
    """The port a sender rank listens on is the port a receiver addresses it on."""
    listening = sender_zmq_port({"zmq_port": 40000, "local_rank": rank})
    assert sender_endpoint("10.0.0.5", 40000, rank) == {
        "source_host": "10.0.0.5",
        "source_port": listening,
    }
    assert sender_endpoint(None, 40000, rank) is None


# -- send ---------------------------------------------------------------------------------


def test_send_retries_until_the_backend_accepts(ns: str) -> None:
    tx, rx = _pair(ns, SessionPolicy(retry_backoff=0.001), fail_puts=2)
    data, chunk = _blocks_payload(_caches())
    assert tx.send("k", data, chunk_bytes=chunk) > 0
    assert rx.discard("k", None)


def test_send_gives_up_after_its_retries(ns: str) -> None:
    tx, _rx = _pair(ns, SessionPolicy(send_retries=3, retry_backoff=0.001), fail_puts=5)
    data, chunk = _blocks_payload(_caches())
    with pytest.raises(KVTransferError, match="after 3 attempts"):
        tx.send("k", data, chunk_bytes=chunk)
    assert fake_backend.live_keys(ns) == []


def test_a_payload_that_cannot_be_framed_is_not_retried(ns: str) -> None:
    tx, _rx = _pair(ns, SessionPolicy(retry_backoff=5.0))
    t0 = time.monotonic()
    with pytest.raises(KVPayloadError):
        tx.send("k", {"bad": object()})
    assert time.monotonic() - t0 < 1.0


# -- receive ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["blocks", "tokens"])
def test_receive_into_writes_the_reference_tokens(ns: str, fmt: str) -> None:
    src, dst = _caches(0), _caches(1)
    tx, rx = _pair(ns)
    if fmt == "blocks":
        data, chunk = _blocks_payload(src)
    else:
        data, chunk = extract_request_kv("req", SRC_IDS, SEQ, src), BS * 4 * 64 * 2
    size = tx.send("k", data, chunk_bytes=chunk)
    tokens, moved = _receive(rx, dst)
    assert tokens == SEQ and 0 < moved <= size
    _assert_tokens(dst, src, 0, SEQ)


def test_a_prefix_hit_moves_only_the_missing_blocks(ns: str) -> None:
    src, dst = _caches(0), _caches(1)
    before = [c.clone() for c in dst]
    tx, rx = _pair(ns)
    data, chunk = _blocks_payload(src)
    size = tx.send("k", data, chunk_bytes=chunk)
    start = 6 * BS  # the consumer holds the first six blocks
    tokens, moved = _receive(rx, dst, start=start)
    assert tokens == SEQ
    _assert_tokens(dst, src, start, SEQ)
    for d, b in zip(dst, before, strict=True):  # the held blocks are untouched
        assert torch.equal(d[DST_IDS[:6]], b[DST_IDS[:6]])
    tail = 4 * chunk * LAYERS  # four blocks of every layer
    assert tail <= moved < tail + 16384, (moved, size)  # plus header and trailer


def test_layer_parts_arrive_and_join(ns: str) -> None:
    src, dst = _caches(0), _caches(1)
    tx, rx = _pair(ns, SessionPolicy(max_part_bytes=1))  # one layer per part
    data, chunk = _blocks_payload(src)
    tx.send("k", data, chunk_bytes=chunk)
    assert len(fake_backend.live_keys(ns)) == LAYERS
    assert _receive(rx, dst)[0] == SEQ
    _assert_tokens(dst, src, 0, SEQ)
    tx.send("k2", extract_request_blocks("req", SRC_IDS, SEQ, src), chunk_bytes=chunk)
    joined, _moved = rx.fetch("k2", None, time.monotonic() + 5)
    assert len(joined["layer_blocks"]["kv_blocks"]) == LAYERS


def test_streamed_payload_is_written_while_it_arrives(ns: str) -> None:
    src, dst = _caches(0), _caches(1)
    tx, rx = _pair(ns, streaming=True, step_s=0.005)
    data, chunk = _blocks_payload(src)
    threading.Thread(target=tx.send, args=("k", data), kwargs={"chunk_bytes": chunk}).start()
    assert _receive(rx, dst)[0] == SEQ
    _assert_tokens(dst, src, 0, SEQ)


def test_corruption_in_a_needed_block_is_refused(ns: str) -> None:
    src, dst = _caches(0), _caches(1)
    tx, rx = _pair(ns, corrupt_next=-2)  # a chunk near the end: a tail block
    data, chunk = _blocks_payload(src)
    tx.send("k", data, chunk_bytes=chunk)
    with pytest.raises(KVPayloadError):
        _receive(rx, dst, start=6 * BS)


def test_nothing_published_times_out_at_the_deadline(ns: str) -> None:
    _tx, rx = _pair(ns)
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="no KV payload"):
        _receive(rx, _caches(1), timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 1.0


def test_polls_back_off_to_the_cap(ns: str) -> None:
    tx, rx = _pair(ns, SessionPolicy(poll_interval=0.001, max_poll_interval=0.02), delay_s=0.4)
    calls = 0
    inner = rx.backend.open_stream

    def counting(*args: object, **kw: object) -> object:
        nonlocal calls
        calls += 1
        return inner(*args, **kw)  # type: ignore[arg-type]

    rx.backend.open_stream = counting  # type: ignore[method-assign]
    data, chunk = _blocks_payload(_caches())
    tx.send("k", data, chunk_bytes=chunk)
    _receive(rx, _caches(1))
    # doubling from 1 ms to the 20 ms cap over 0.4 s: about 5 + 0.4 / 0.02 polls
    assert 10 <= calls <= 40, calls


def test_cancel_stops_a_waiting_receive_within_a_poll_interval(ns: str) -> None:
    _tx, rx = _pair(ns, SessionPolicy(poll_interval=0.001, max_poll_interval=0.02))
    cancel = threading.Event()
    set_at: list[float] = []

    def cancel_now() -> None:
        set_at.append(time.monotonic())
        cancel.set()

    threading.Timer(0.2, cancel_now).start()
    with pytest.raises(KVTransferCancelled):
        rx.receive_into("k", None, time.monotonic() + 30, lambda p, s: None, cancel)  # type: ignore[arg-type,return-value]
    # seen at the next poll (at most 20 ms apart), not at the deadline; the rest is slack
    # for a loaded machine (the other test worker may be running an engine)
    assert time.monotonic() - set_at[0] < 0.02 + 0.2


def test_cancel_stops_a_streamed_load(ns: str) -> None:
    src, dst = _caches(0), _caches(1)
    tx, rx = _pair(ns, streaming=True, step_s=0.05)
    data, chunk = _blocks_payload(src)
    threading.Thread(target=tx.send, args=("k", data), kwargs={"chunk_bytes": chunk}).start()
    cancel = threading.Event()

    def plan(part: dict, layer_start: int) -> object:
        threading.Timer(0.05, cancel.set).start()
        return plan_injection(part, dst[layer_start:], DST_IDS)

    t0 = time.monotonic()
    with pytest.raises(KVTransferCancelled):
        rx.receive_into("k", None, time.monotonic() + 30, plan, cancel)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.5
    assert rx.backend.health()["open_streams"] == 0
    time.sleep(0.5)  # let the producer thread finish packing before the leak check


def test_discard_releases_every_part_without_moving_bytes(ns: str) -> None:
    tx, rx = _pair(ns, SessionPolicy(max_part_bytes=1))
    data, chunk = _blocks_payload(_caches())
    tx.send("k", data, chunk_bytes=chunk)
    assert len(fake_backend.live_keys(ns)) == LAYERS
    assert rx.discard("k", None) is True
    assert fake_backend.live_keys(ns) == []
    assert rx.discard("k", None) is False
