"""A move out of a registered cache is one engine post, whatever its page count.

Engine-free part: :class:`PageReads` names exactly the bytes torch's own page views
name (addresses from ``storage_offset`` / ``data_ptr``, not from the code under test).
Engine part: a sender and a receiver connector with ``register_cache`` (real NIXL/UCX or
Mooncake TCP on 127.0.0.1, both in this process) move 4, 64 and 1,024 shuffled pages per
layer; the receiver's transport object is wrapped to count its calls. NIXL posts one
transfer per move, made by index into two prepared lists (prepared on the first move
only); Mooncake posts one batch per 2,048 ranges (its limit). The pages are compared
with the sender's with ``torch.equal``. A packed frame of tensors is pulled in at most two
transfers at any size: its head and digest trailer (which the sender's acquire reply
carries when they fit in 16 KiB), then its body, no byte twice; a frame of at most 16 KiB
comes with the reply whole (no transfer), but never from the caller's metadata
(:mod:`.test_acquire_replies` checks what a reply may carry).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _kv_fixtures import lbnhc_views

from vllm_omni_kv.backends.pull.page_reads import PageReads
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.move_plan import MovePlan, Pages
from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry, shared_fields
from vllm_omni_kv.wire import codec

from ..conformance import PULL_ENGINES, pull_backend

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 1100, 2, 16, 32
PAGE = HEADS * BS * 2 * DIM * 4  # fp32 K|V: 8 KiB
LAYER_BYTES = BLOCKS * PAGE
IDENT = KVLayoutId("k_v", "LBNHC", "float32", BS, BS, HEADS, DIM, 4)
FROM, TO = "prefill", "decode"


def _views(buf: torch.Tensor) -> list[torch.Tensor]:
    return lbnhc_views(buf, LAYERS, BLOCKS, HEADS, BS, DIM)


def _pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return list(zip(rng.sample(range(BLOCKS), n), rng.sample(range(BLOCKS), n), strict=True))


# -- PageReads against torch's own views ---------------------------------------------------


def _expected(src: list[torch.Tensor], dst: list[torch.Tensor], base: int, groups: Any) -> Counter:
    """Every page read as ``(local, remote, bytes)``, from the views' own offsets."""
    want: Counter = Counter()
    for layers, pairs in groups:
        for i in layers:
            sp, dp = page_view(src[i], IDENT), page_view(dst[i], IDENT)
            per = math.prod(sp.shape[1:]) * sp.element_size()
            for s, d in pairs:
                remote = base + sp[s].storage_offset() * sp.element_size()
                want[(dp[d].data_ptr(), remote, per)] += 1
    return want


def _pages_of(ranges: list[tuple[int, int, int]]) -> Counter:
    """The ranges cut back into pages."""
    got: Counter = Counter()
    for local, remote, n in ranges:
        assert n % PAGE == 0
        for j in range(n // PAGE):
            got[(local + j * PAGE, remote + j * PAGE, PAGE)] += 1
    return got


def _tables(reads: PageReads) -> Counter:
    """The reads through the tables and indices (how a prepared list resolves them)."""

    def expand(tables: Any) -> list[tuple[int, int]]:
        return [(t.base + i * t.stride, t.page_bytes) for t in tables for i in range(t.count)]

    remote, local = expand(reads.remote), expand(reads.local)
    got: Counter = Counter()
    for r, d in zip(reads.remote_ids.tolist(), reads.local_ids.tolist(), strict=True):
        assert remote[r][1] == local[d][1]
        got[(local[d][0], remote[r][0], remote[r][1])] += 1
    return got


@pytest.mark.parametrize("local_blocks", [BLOCKS, 40], ids=["same-size", "smaller-local"])
def test_page_reads_name_the_bytes_of_the_views(local_blocks: int) -> None:
    base = 1 << 40  # the producer's region, never touched (a meta tensor)
    src = _views(torch.empty(LAYERS * LAYER_BYTES, dtype=torch.int8, device="meta"))
    buf = torch.zeros(LAYERS * local_blocks * PAGE, dtype=torch.int8)
    dst = lbnhc_views(buf, LAYERS, local_blocks, HEADS, BS, DIM)
    groups = [([0, 2], [(5, 1), (6, 2), (7, 3), (100, 0)]), ([1], [(9, 9), (1000, 39)])]
    plan = MovePlan(
        [page_view(v, IDENT) for v in src],
        [page_view(v, IDENT) for v in dst],
        [Pages(layers, pairs) for layers, pairs in groups],
    )
    reads = PageReads.of_plan(plan, base)
    want = _expected(src, dst, base, groups)
    assert _tables(reads) == want
    ranges = reads.ranges()
    assert _pages_of(ranges) == want
    assert reads.nbytes == sum(n for _l, _r, n in ranges) == PAGE * 10
    assert len(ranges) == 2 + 2 + 2  # (5,6,7)->(1,2,3) merged in layers 0 and 2


# -- one post per move, on real engines -------------------------------------------------------


class Counting:
    """Delegates to ``inner``, counting calls by method name."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, Counter()
        self.args: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            self.args.append((name, a))
            return attr(*a, **kw)

        return call

    def clear(self) -> None:
        self.calls.clear()
        self.args.clear()


class Pair:
    """A sender and a receiver connector, each with a registered, vLLM-like cache."""

    def __init__(self, engine: str) -> None:
        cls, config = pull_backend(engine)
        self.sender = cls(config("sender", pool_mib=8, register_cache=True))
        self.receiver = cls(config("receiver", pool_mib=8, register_cache=True))
        info = self.sender.get_connection_info()
        self.receiver.update_sender_info(info["host"], info["zmq_port"])
        self.src_buf, self.src = self._cache(self.sender, seed=7)
        self.dst_buf, self.dst = self._cache(self.receiver, seed=None)
        got = self.sender.cache_region.export(self.src)
        assert got is not None
        self.desc, base, nbytes = got
        self.geometry = layer_geometry(self.src, base, nbytes)

    @staticmethod
    def _cache(c: Any, seed: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with c.cache_region.allocation_context():
            buf = torch.zeros(LAYERS * LAYER_BYTES, dtype=torch.int8)
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            buf.copy_(torch.randint(-128, 128, buf.shape, generator=g, dtype=torch.int8))
        return buf, _views(buf)

    def move(self, pairs: list[tuple[int, int]], calls: Counter) -> int:
        """Publish the pages of ``pairs`` (with digests) and copy them as a load does;
        ``calls`` is cleared once the payload's frame is read (it counts the copy)."""
        key = f"req-{uuid.uuid4().hex[:8]}"
        src_ids = [s for s, _ in pairs]
        hold = self.sender.cache_region.hold(FROM, TO, key)
        shared = {"region": self.desc, "hold": hold, "geometry": self.geometry}
        data = describe_request(
            key, src_ids, len(src_ids) * BS, self.src, IDENT, shared, digests=True
        )
        self.sender.put(FROM, TO, key, data)
        stream = self.receiver.open_stream(FROM, TO, key)
        assert stream is not None
        with stream:
            _meta, fields, ids = shared_fields(stream.obj)
            region = self.receiver.cache_region
            calls.clear()
            with region.reading(fields["hold"]):
                got = list(zip(ids, [d for _, d in pairs], strict=True))
                return int(
                    region.copy_into(
                        fields["region"],
                        fields["geometry"],
                        IDENT,
                        self.dst,
                        got,
                        fields["sums"],
                        0,
                    )
                )

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture(scope="module", params=PULL_ENGINES)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    try:
        yield p
    finally:
        p.close()


@contextlib.contextmanager
def counting(pair: Pair) -> Iterator[tuple[Counting, bool]]:
    """The receiver's transport object (NIXL's agent, Mooncake's engine) wrapped in a
    :class:`Counting` for the block; yields it and whether the engine is NIXL's."""
    engine = pair.receiver.engine
    nixl = hasattr(engine, "agent")
    inner = Counting(engine.agent if nixl else engine.engine)
    if nixl:
        engine.agent = inner
    else:
        engine.engine = inner
    try:
        yield inner, nixl
    finally:
        if nixl:
            engine.agent = inner.inner
        else:
            engine.engine = inner.inner


def test_posts_per_move_do_not_grow_with_pages(pair: Pair) -> None:
    with counting(pair) as (inner, nixl):
        counts = {}
        for n in (4, 64, 1024):
            pairs = _pairs(n, seed=n)
            assert pair.move(pairs, inner.calls) == n * LAYERS * PAGE
            for w, g in zip(pair.src, pair.dst, strict=True):
                wp, gp = page_view(w, IDENT), page_view(g, IDENT)
                s_ids, d_ids = [s for s, _ in pairs], [d for _, d in pairs]
                assert torch.equal(gp[d_ids].view(torch.int32), wp[s_ids].view(torch.int32))
            counts[n] = {k: v for k, v in inner.calls.items() if k != "check_xfer_state"}
    if nixl:
        # the sender's metadata is loaded and the tables are prepared once (both sides, first
        # move; the payload's small frame came with the acquire reply, so no read before
        # it); then one request, one post (polls of its state aside)
        assert counts[4].pop("add_remote_agent", 0) <= 1
        assert counts[4].pop("prep_xfer_dlist") == 2
        assert counts[4] == counts[64] == counts[1024] == {"make_prepped_xfer": 1, "transfer": 1}
    else:  # one batch per 2,048 ranges: 3 layers x 1,024 shuffled pages need two
        posts = {n: c["batch_transfer_sync_read"] for n, c in counts.items()}
        assert posts == {4: 1, 64: 1, 1024: 2}, counts


#: what each engine reports carried the reads (``UCX_TLS`` unset in tests)
CARRIED_BY = {"nixl": "nixl:UCX", "mooncake_te": "mooncake_te:tcp"}


def test_the_transport_is_on_record(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """(After the count above: this one makes the receiver prepare its lists again.) Health and the load path name what carries the reads; NIXL logs, at a peer's
    handshake, both sides' registered memory kinds and its transports."""
    name = pair.receiver.backend_name
    assert pair.receiver.transport() == CARRIED_BY[name]
    assert pair.receiver.health()["transport"] == CARRIED_BY[name]
    if name != "nixl":
        return
    import logging

    pair.receiver.engine.forget(pair.sender.engine.session)  # the next read handshakes
    with caplog.at_level(logging.INFO, logger="vllm_omni_kv.backends.nixl.handshake"):
        assert pair.move(_pairs(4, seed=1), Counter()) == 4 * LAYERS * PAGE
    said = [r.getMessage() for r in caplog.records if "NIXL peer" in r.getMessage()]
    assert len(said) == 1, said
    assert "its memory ['DRAM:0']" in said[0] and "over UCX" in said[0], said


#: Mooncake's binding calls that post reads: one range submitted (then polled), a range or a
#: batch of ranges waited for
ASYNC_READ = "batch_transfer_async_read"
MOONCAKE_READS = (ASYNC_READ, "transfer_sync_read", "batch_transfer_sync_read")


def _transfers(inner: Counting) -> int:
    """Transfers the engine was asked for (NIXL: ``transfer``; Mooncake: a read waited
    for, or one-range reads submitted back to back, in flight together)."""
    n, prev = 0, ""
    for name, _a in inner.args:
        if name == "transfer" or (name in MOONCAKE_READS and not name == prev == ASYNC_READ):
            n += 1
        prev = name
    return n


def _frame_transfers(pair: Pair, data: dict[str, Any], planned: bool) -> tuple[int, int]:
    """Transfers posted while a stream on ``data`` opens and in all, its load checked
    against ``data``; ``planned``: opened from the put's metadata (no ``acquire``)."""
    key = f"frame-{uuid.uuid4().hex[:8]}"
    _ok, _size, meta = pair.sender.put(FROM, TO, key, data)
    with counting(pair) as (inner, _nixl):
        stream = pair.receiver.open_stream(FROM, TO, key, meta if planned else None)
        assert stream is not None
        with stream:
            opened = _transfers(inner)
            for _ in stream.load(None, time.monotonic() + 20):
                pass
            for name, value in data.items():
                assert torch.equal(stream.obj[name], value)
        return opened, _transfers(inner)


@pytest.mark.parametrize("planned", [False, True], ids=["acquired", "planned"])
def test_a_frame_is_pulled_in_at_most_two_transfers_at_any_size(pair: Pair, planned: bool) -> None:
    """A packed frame of tensors, 256 KiB and 4 MiB: opened through an ``acquire``, its
    prelude, header and digest trailer come with the sender's reply and the load pulls its
    body in one transfer; opened from the put's metadata (no reply), the head and trailer
    (first and last bytes) take one transfer when the stream opens."""
    for mib4 in (1, 16):  # quarter MiB
        data = {"kv": torch.randint(0, 1 << 30, (mib4 << 16,), dtype=torch.int32)}
        assert _frame_transfers(pair, data, planned) == ((1, 2) if planned else (0, 1))


def test_a_frame_whose_head_is_too_large_for_the_reply_is_pulled(pair: Pair) -> None:
    """A head and trailer over 16 KiB together (hundreds of tensors) do not go in the
    ``acquire`` reply: the stream pulls them when it opens."""
    data = {f"layer.{i}.kv_cache": torch.full((64,), i, dtype=torch.int32) for i in range(350)}
    frame = bytes(codec.encode(data).to_bytearray())
    p = codec.read_prelude(frame, len(frame))
    assert p.data_start <= 16 << 10 < p.data_start + p.trailer_len  # one transfer opens it
    assert _frame_transfers(pair, data, planned=False) == (1, 2)


def _read_bytes(args: list[tuple[str, tuple[Any, ...]]]) -> int:
    """Bytes Mooncake's engine was asked to read: ``(session, local, remote, length)``
    per read, lists of them per batch."""
    n = 0
    for name, a in args:
        if name == "transfer_sync_read":
            n += a[3]
        elif name in MOONCAKE_READS:
            n += sum(a[3])
    return n


@pytest.mark.parametrize("planned", [False, True], ids=["acquired", "planned"])
@pytest.mark.parametrize(
    "shape",
    ["256 KiB", "4 MiB", "4 MiB + blob"],
)
def test_no_byte_of_a_frame_is_pulled_twice(pair: Pair, shape: str, planned: bool) -> None:
    """The frame's first and last bytes (pulled when the stream opens, or carried by the
    ``acquire`` reply) and the load's ranges never overlap (the trailer's last chunk, a
    blob that decoding needed): the bytes moved add up to the frame's size (opened from the
    put's metadata) or to its head, trailer and data (through an ``acquire``), counted by the
    stream, and (Mooncake) the engine is asked for exactly the bytes no reply carried."""
    n = (1 << 16) if shape == "256 KiB" else (1 << 20)
    data: dict[str, Any] = {"kv": torch.randint(0, 1 << 30, (n,), dtype=torch.int32)}
    if "blob" in shape:
        data["note"] = bytes(random.Random(5).randbytes(300_000))
    key = f"once-{uuid.uuid4().hex[:8]}"
    _ok, size, meta = pair.sender.put(FROM, TO, key, data)
    frame = bytes(codec.encode(data).to_bytearray())
    p = codec.read_prelude(frame, len(frame))
    carried = 0 if planned else p.data_start + p.trailer_len
    # what a load needs: the head, the trailer and the data spans (the padding between
    # spans is covered by nothing); opening a planned pull also takes the padding near
    # the frame's ends, within its first and last bytes
    spans = data["kv"].numel() * 4 + len(data.get("note", b""))
    want = size if planned else carried + spans
    with counting(pair) as (inner, nixl):
        stream = pair.receiver.open_stream(FROM, TO, key, meta if planned else None)
        assert stream is not None
        with stream:
            for _ in stream.load(None, time.monotonic() + 20):
                pass
            assert torch.equal(stream.obj["kv"], data["kv"])
            assert stream.obj.get("note") == data.get("note")
            moved = stream.moved
    assert moved == want, (moved, want, size)
    if not nixl:
        assert _read_bytes(inner.args) == want - carried


@pytest.mark.parametrize("kind", ["frame", "tensor"])
@pytest.mark.parametrize("kib", [4, 24])
def test_a_small_block_comes_with_the_acquire_reply(pair: Pair, kib: int, kind: str) -> None:
    """A block of at most 16 KiB (a ``register_cache`` payload's frame of block ids and
    geometry, or a small tensor put on the fast path) is in the sender's ``acquire`` reply:
    getting it posts no engine transfer. A larger one is pulled (one transfer). Either way
    the pull ends with a release: the sender then frees the block (``max_pulls`` 1), so the
    key is gone."""
    ids = torch.arange(kib * 256, dtype=torch.int32)  # kib KiB
    key = f"small-{kind}-{kib}-{uuid.uuid4().hex[:8]}"
    pair.sender.put(FROM, TO, key, {"ids": ids} if kind == "frame" else ids)
    with counting(pair) as (inner, _nixl):
        stream = pair.receiver.open_stream(FROM, TO, key)
        assert stream is not None
        with stream:
            for _ in stream.load(None, time.monotonic() + 20):
                pass
            if kind == "frame":
                assert torch.equal(stream.obj["ids"], ids)
            else:
                got = stream.obj
                assert torch.equal(got.tensor[: ids.numel() * 4].view(torch.int32), ids)
                got.release()
        posts = _transfers(inner)
    assert posts == (0 if kib < 16 else 1), posts
    assert pair.receiver.get(FROM, TO, key) is None  # released and freed


def test_a_frame_in_the_callers_metadata_is_not_trusted(pair: Pair) -> None:
    """Only the sender's reply may carry the frame: a ``frame`` in the metadata a caller
    passes (``kv_transfer_params`` come from clients) is ignored and the frame pulled."""
    data = {"ids": torch.arange(1024, dtype=torch.int32)}
    key = f"forged-{uuid.uuid4().hex[:8]}"
    _ok, size, meta = pair.sender.put(FROM, TO, key, data)
    assert meta is not None
    forged = bytes(codec.encode({"ids": torch.zeros(1024, dtype=torch.int32)}).to_bytearray())
    assert len(forged) == size  # a valid frame of the same length, with other values
    stream = pair.receiver.open_stream(FROM, TO, key, {**meta, "frame": forged})
    assert stream is not None
    with stream:
        for _ in stream.load(None, time.monotonic() + 20):
            pass
        assert torch.equal(stream.obj["ids"], data["ids"])
