"""Streamed shared-memory frames: a reader follows the producer's progress (real processes)."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _mp import CTX

from vllm_omni_kv import (
    KVPayloadError,
    KVTransferError,
    KVTransferTimeout,
    OmniKVCacheConfig,
    OmniKVTransferManager,
    SharedMemoryConnector,
)
from vllm_omni_kv.backends.shm import arena as shm_arena
from vllm_omni_kv.backends.shm.connector import index_name
from vllm_omni_kv.backends.shm.reader import ShmFrameStream
from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.wire.codec import LazyTensor

N = 4 << 20  # tensor bytes of the gated payload
HALF = N // 2


def _pattern() -> torch.Tensor:
    return (torch.arange(N, dtype=torch.int64) % 251).to(torch.uint8)


def _gated_payload(mode: str, reached: Any, go: Any) -> dict[str, Any]:
    """One uint8 tensor whose second half is written only once ``go`` is set."""
    src = _pattern()

    def fill(dst: torch.Tensor) -> Iterator[int]:
        dst[:HALF].copy_(src[:HALF])
        yield HALF
        reached.set()
        go.wait(120)
        if mode == "fail":
            raise RuntimeError("gather failed mid-payload")
        dst[HALF:].copy_(src[HALF:])
        yield N

    return {"t": LazyTensor((N,), torch.uint8, fill), "note": mode}


def _producer(
    ns: str, key: str, mode: str, reached: Any, go: Any, q: Any, again: Any, leave: Any
) -> None:
    """Stream one gated payload; then, once told, put an ungated one of the same size and
    report how many arena segments exist (1 means the first segment came back to the pool)."""
    conn = SharedMemoryConnector({"namespace": ns, "stream": True})
    try:
        try:
            conn.put("0", "1", key, _gated_payload(mode, reached, go))
            q.put(("put", "ok"))
        except RuntimeError as e:
            q.put(("put", str(e)))
        again.wait(120)  # the test has released the first segment (or never claimed it)
        conn.put("0", "1", key + "-again", {"t": _pattern(), "note": "again"})
        q.put(("segments", len(conn._arena._segments)))
        leave.wait(120)
    finally:
        conn.close()


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return f"st{os.getpid()}_{request.node.name[:40]}"


@pytest.fixture
def pair(ns: str) -> Iterator[tuple[SharedMemoryConnector, SharedMemoryConnector]]:
    """A streaming producer connector and a reader on one namespace."""
    with (
        SharedMemoryConnector({"namespace": ns, "stream": True}) as tx,
        SharedMemoryConnector({"namespace": ns}) as rx,
    ):
        yield tx, rx


@pytest.fixture
def producer(ns: str) -> Iterator[Any]:
    """Start ``_producer`` in its own process: ``start(mode)`` -> (process, go, queue, again)."""
    procs: list[Any] = []
    leave, agains = CTX.Event(), []

    def start(mode: str) -> tuple[Any, Any, Any, Any]:
        reached, go, q, again = CTX.Event(), CTX.Event(), CTX.Queue(), CTX.Event()
        p = CTX.Process(target=_producer, args=(ns, "k", mode, reached, go, q, again, leave))
        p.start()
        procs.append(p)
        agains.append(again)
        assert reached.wait(60), "the producer never reached the middle of its payload"
        return p, go, q, again

    yield start
    for again in agains:
        again.set()
    leave.set()
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
            p.join(5)


def _open(conn: SharedMemoryConnector, key: str = "k") -> Any:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = conn.open_stream("0", "1", key)
        if s is not None:
            return s
        time.sleep(0.002)
    raise AssertionError("no stream opened")


def _tensor_bytes(obj: dict[str, Any]) -> bytes:
    return obj["t"].numpy().tobytes()


def test_stream_hands_out_bytes_before_the_producer_finishes(ns: str, producer: Any) -> None:
    _p, go, q, again = producer("ok")
    with SharedMemoryConnector({"namespace": ns}) as conn:
        stream = _open(conn)
        assert isinstance(stream, ShmFrameStream) and stream.obj["note"] == "ok"
        t = stream.obj["t"]
        base = t.data_ptr() - stream.frame_address
        ready = stream.ready(time.monotonic() + 30)
        first = 0
        while first < base + HALF:  # the first half is final while the producer waits
            first = next(ready)
        assert first < stream.size
        assert t[:HALF].numpy().tobytes() == _pattern()[:HALF].numpy().tobytes()
        go.set()
        rest = list(ready)
        assert rest and rest[-1] == stream.size  # ...and the checksum matched
        assert _tensor_bytes(stream.obj) == _pattern().numpy().tobytes()
        with pytest.raises(KVTransferError, match="only once"):
            next(stream.ready(time.monotonic() + 1))
        del t
        stream.close()
        again.set()
        assert q.get(timeout=30) == ("put", "ok")
        assert q.get(timeout=30) == ("segments", 1)  # the reader gave the segment back
        got = conn.get("0", "1", "k-again")
        assert got is not None and _tensor_bytes(got[0]) == _pattern().numpy().tobytes()


def test_plain_get_waits_until_a_streamed_entry_is_complete(ns: str, producer: Any) -> None:
    _p, go, q, _again = producer("ok")
    with SharedMemoryConnector({"namespace": ns}) as conn:
        time.sleep(0.05)
        assert conn.get("0", "1", "k") is None  # half written: not claimed, not returned
        assert os.path.exists(os.path.join(shm_arena.SHM_DIR, index_name(ns, "0", "1", "k")))
        go.set()
        assert q.get(timeout=30) == ("put", "ok")
        got = conn.get("0", "1", "k")
        assert got is not None and _tensor_bytes(got[0]) == _pattern().numpy().tobytes()


def test_producer_failure_mid_stream_is_reported_at_once(ns: str, producer: Any) -> None:
    _p, go, q, again = producer("fail")
    with SharedMemoryConnector({"namespace": ns}) as conn:
        stream = _open(conn)  # claimed while the producer is mid-write
        go.set()  # ...which then fails
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="failed while writing"):
            for _ in stream.ready(time.monotonic() + 30):
                pass
        assert time.monotonic() - t0 < 2  # not at the deadline
        stream.close()
        again.set()
        assert q.get(timeout=30) == ("put", "gather failed mid-payload")
        assert q.get(timeout=30) == ("segments", 1)  # the aborted segment was reused


def test_failed_put_withdraws_its_streamed_entry(ns: str) -> None:
    def fill(dst: torch.Tensor) -> Iterator[int]:
        dst[:HALF].fill_(1)
        yield HALF
        raise RuntimeError("gather failed")

    with SharedMemoryConnector({"namespace": ns, "stream": True}) as tx:
        with pytest.raises(RuntimeError, match="gather failed"):
            tx.put("0", "1", "k", {"t": LazyTensor((N,), torch.uint8, fill)})
        assert not os.path.exists(os.path.join(shm_arena.SHM_DIR, index_name(ns, "0", "1", "k")))
        assert [s.state()[0] for s in tx._arena._segments] == [shm_arena.FREE]
        assert tx.health()["unconsumed"] == 0
        tx.put("0", "1", "k", {"t": _pattern()})  # the key is usable again
        assert len(tx._arena._segments) == 1


def test_killed_producer_mid_stream_is_detected(ns: str, producer: Any) -> None:
    p, _go, _q, _again = producer("ok")
    with SharedMemoryConnector({"namespace": ns}) as conn:
        stream = _open(conn)
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="exited while writing"):
            for _ in stream.ready(time.monotonic() + 30):
                pass
        assert time.monotonic() - t0 < 2  # noticed long before the deadline
        stream.close()
    p.join(10)
    shm_arena.sweep_orphans()
    left = [n for n in os.listdir(shm_arena.SHM_DIR) if str(p.pid) in n]
    assert left == []


def test_stalled_producer_times_out_and_its_segment_is_reclaimed(ns: str, producer: Any) -> None:
    _p, go, q, again = producer("ok")
    with SharedMemoryConnector({"namespace": ns}) as conn:
        stream = _open(conn)
        with pytest.raises(KVTransferTimeout, match="before the deadline"):
            for _ in stream.ready(time.monotonic() + 0.3):
                pass
        stream.close()  # gives up mid-write: the producer frees the segment when done
        go.set()
        again.set()
        assert q.get(timeout=30) == ("put", "ok")
        assert q.get(timeout=30) == ("segments", 1)


def test_corrupted_streamed_frame_fails_its_checksum(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    tx, rx = pair
    tx.put("0", "1", "k", {"t": _pattern()})
    seg = tx._arena._segments[0]
    fd = os.open(os.path.join(shm_arena.SHM_DIR, seg.name), os.O_RDWR)
    with mmap.mmap(fd, 0) as mm:
        mm[shm_arena.DATA_OFFSET + 4096] ^= 0xFF
    os.close(fd)
    stream = rx.open_stream("0", "1", "k")
    assert stream is not None
    with pytest.raises(KVPayloadError, match="checksum mismatch"):
        for _ in stream.ready(time.monotonic() + 5):
            pass
    stream.close()
    assert seg.state()[0] == shm_arena.FREE


def test_non_streaming_connector_opens_lazily_verified_streams(ns: str) -> None:
    with (
        SharedMemoryConnector({"namespace": ns, "stream": False}) as tx,
        SharedMemoryConnector({"namespace": ns, "stream": False}) as rx,
    ):
        assert not tx.supports_streaming
        tx.put("0", "1", "k", {"t": _pattern()})
        stream = rx.open_stream("0", "1", "k")
        assert isinstance(stream, ShmFrameStream)
        assert list(stream.ready(0.0))[-1] == stream.size
        assert _tensor_bytes(stream.obj) == _pattern().numpy().tobytes()
        stream.close()


def test_views_outlive_the_stream_and_pin_the_segment(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    tx, rx = pair
    tx.put("0", "1", "a", {"t": _pattern()})
    stream = rx.open_stream("0", "1", "a")
    assert isinstance(stream, ShmFrameStream)
    for _ in stream.ready(time.monotonic() + 5):
        pass
    t = stream.obj["t"]
    stream.close()
    tx.put("0", "1", "b", {"t": torch.zeros(N, dtype=torch.uint8)})
    assert len(tx._arena._segments) == 2  # the first one is still pinned by `t`
    assert t.numpy().tobytes() == _pattern().numpy().tobytes()
    del t  # the last view: the segment goes back to the pool
    assert rx.get("0", "1", "b") is not None
    tx.put("0", "1", "c", {"t": _pattern()})
    assert len(tx._arena._segments) == 2


def test_frames_with_byte_blobs_are_published_complete(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    blob = bytes(range(256)) * 64  # travels as a raw blob, which decoding copies
    tx, rx = pair
    tx.put("0", "1", "k", {"t": _pattern(), "blob": blob})
    seg = tx._arena._segments[0]
    assert seg.state()[0] == shm_arena.PUBLISHED  # written in full before its entry appeared
    stream = rx.open_stream("0", "1", "k")
    assert isinstance(stream, ShmFrameStream) and stream.obj["blob"] == blob
    stream.close()


def test_a_segment_abandoned_after_its_producer_finished_is_reused(ns: str) -> None:
    """The reader gave up just as the producer finished: ``acquire`` reclaims the segment."""
    with SharedMemoryConnector({"namespace": ns, "stream": True}) as tx:
        tx.put("0", "1", "a", {"t": _pattern()})
        seg = tx._arena._segments[0]
        state, gen, _progress, _abandoned = seg.full_state()
        assert state == shm_arena.PUBLISHED
        assert shm_arena.claim_index(index_name(ns, "0", "1", "a")) is not None
        seg.abandon(gen)  # as a reader that saw STREAMING, after the producer's last check
        assert seg.reusable()
        tx.put("0", "1", "b", {"t": _pattern()})
        assert len(tx._arena._segments) == 1 and seg.full_state()[1] == gen + 1


def test_a_released_segment_is_not_read_as_in_progress(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    tx, rx = pair
    tx.put("0", "1", "a", {"t": _pattern()})
    stream = rx.open_stream("0", "1", "a")
    assert isinstance(stream, ShmFrameStream)
    seg = tx._arena._segments[0]
    seg.set_state(shm_arena.FREE, seg.state()[1])  # a bug elsewhere released it
    with pytest.raises(KVPayloadError, match="released or reused while being read"):
        for _ in stream.ready(time.monotonic() + 5):
            pass
    stream.close()


# -- the manager's receive_kv_cache_into over a streamed frame ---------------------------------

LAYERS, HEADS, BS, DIM2 = 3, 2, 32, 128


def _caches(seed: int, nblocks: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(nblocks, HEADS, BS, DIM2, generator=g) for _ in range(LAYERS)]


def _mgr(ns: str, *, send: bool, stream: bool) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": ns, "stream": stream},
            from_stage="prefill",
            to_stage="decode",
            need_send_cache=send,
            need_recv_cache=not send,
            recv_timeout=30.0,
        )
    )


def _send(ns: str, stream: bool, fmt: str, ids: list[int], tokens: int, go: Any, read: Any) -> None:
    """Send one request; layer 1 is packed only once ``go`` is set (if given); the arena
    lives until the receiver sets ``read``."""
    with _mgr(ns, send=True, stream=stream) as mgr:
        caches = _caches(1)
        if fmt == "blocks":
            data = extract_request_blocks("req", ids, tokens, caches)
            layers = data.layer_blocks["kv_blocks"]
        else:
            data = mgr.extract_kv_cache("req", ids, tokens, caches, BS, "auto", lazy=True)
            layers = data.layer_blocks["key_cache"]
        if go is not None:
            lazy = layers[1]

            def gated(dst: torch.Tensor, fill: Any = lazy.fill) -> Any:
                go.wait(60)
                return fill(dst)

            layers[1] = LazyTensor(lazy.shape, lazy.dtype, gated)
        assert mgr.send_kv_cache("req", data)
        read.wait(60)  # keep the arena alive while the receiver reads


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("fmt", ["blocks", "tokens"])
def test_receive_into_gets_bit_identical_blocks(ns: str, stream: bool, fmt: str) -> None:
    src_ids, dst_ids, tokens = [7, 3, 30, 31, 32, 12], [0, 5, 6, 7, 20, 39], 6 * BS - 5
    read = CTX.Event()
    p = CTX.Process(target=_send, args=(ns, stream, fmt, src_ids, tokens, None, read))
    p.start()
    try:
        dst = _caches(2)
        before = [c.clone() for c in dst]
        with _mgr(ns, send=False, stream=stream) as mgr:
            got = mgr.receive_kv_cache_into("req", list(dst), dst_ids)
        assert got is not None and got[0] == tokens
        src = _caches(1)
        want = extract_request_kv("req", src_ids, tokens, src, lazy=False).layer_blocks
        have = extract_request_kv("req", dst_ids, tokens, dst, lazy=False).layer_blocks
        for name in ("key_cache", "value_cache"):  # every token, K and V, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(have[name], want[name], strict=True))
        for layer in range(LAYERS):
            if fmt == "blocks":  # whole blocks travel
                assert torch.equal(dst[layer][dst_ids], src[layer][src_ids])
            others = [b for b in range(40) if b not in dst_ids]
            assert torch.equal(dst[layer][others], before[layer][others])
    finally:
        read.set()
        p.join(30)


def test_receive_into_writes_blocks_while_the_sender_is_still_packing(ns: str) -> None:
    """With layer 1 held back by the sender, layer 0 is already in the receiver's cache."""
    src_ids, dst_ids, tokens = [7, 3, 30, 31], [0, 5, 6, 7], 4 * BS
    go, read = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_send, args=(ns, True, "blocks", src_ids, tokens, go, read))
    p.start()
    dst = _caches(2)
    src = _caches(1)
    result: list[Any] = []

    def receive() -> None:
        with _mgr(ns, send=False, stream=True) as mgr:
            result.append(mgr.receive_kv_cache_into("req", list(dst), dst_ids))

    th = threading.Thread(target=receive)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not torch.equal(dst[0][dst_ids], src[0][src_ids]):
            assert time.monotonic() < deadline, "layer 0 never arrived while layer 1 was held"
            time.sleep(0.01)
        assert not torch.equal(dst[1][dst_ids], src[1][src_ids]) and th.is_alive()
        go.set()
        th.join(30)
        assert result and result[0] is not None and result[0][0] == tokens
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][dst_ids], src[layer][src_ids])
    finally:
        go.set()
        th.join(30)
        read.set()
        p.join(30)
