"""``register_cache`` (Mooncake TE and NIXL): pulling pages straight out of a producer's
registered cache.

Every test runs once per engine (one implementation, :mod:`...cache_region`, behind
both). The producer runs in its own process (spawned) with a vLLM-like KV cache (one
int8 allocation made inside the region's allocation context, viewed per layer) filled
from a seeded generator; the consumer here rebuilds the expected bytes from the same
seed, independently of the code under test. Transfers are real Mooncake TCP reads or
NIXL/UCX reads on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from _kv_fixtures import lbnhc_views

from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.shared_pages import shared_fields

from ..conformance import nixl_config, pull_backend, te_config

ENGINES = [
    pytest.param(
        "mooncake_te",
        marks=[
            pytest.mark.mooncake,
            pytest.mark.skipif(
                importlib.util.find_spec("mooncake") is None,
                reason="the Mooncake transfer engine wheel is not installed",
            ),
        ],
    ),
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(
                importlib.util.find_spec("nixl") is None, reason="nixl is not installed"
            ),
        ],
    ),
]
CONFIG = {"mooncake_te": te_config, "nixl": nixl_config}

FROM, TO = "prefill", "decode"
LAYERS, BLOCKS, HEADS, BS, DIM = 3, 48, 2, 16, 32
LAYER_BYTES = BLOCKS * HEADS * BS * 2 * DIM * 4  # fp32 K|V, LBNHC
PAGE = HEADS * BS * 2 * DIM * 4
SEED = 1234
IDENT = KVLayoutId("k_v", "LBNHC", "float32", BS, BS, HEADS, DIM, 4)
SRC = [5, 6, 7, 12, 2, 3, 40]  # producer blocks of the request (runs and jumps)


def _fill(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (LAYERS * LAYER_BYTES,), generator=g, dtype=torch.int8)


def _views(buf: torch.Tensor) -> list[torch.Tensor]:
    return lbnhc_views(buf, LAYERS, BLOCKS, HEADS, BS, DIM)


def producer_main(conn: Connection, backend: str, cfg: dict[str, Any]) -> None:
    """Child: a sender with ``register_cache`` and a seeded cache in its region."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry

    c = pull_backend(backend)[0](cfg)
    region = c.cache_region
    assert region is not None
    ctx = region.allocation_context()
    assert ctx is not None
    with ctx:
        buf = torch.zeros(LAYERS * LAYER_BYTES, dtype=torch.int8)
    buf.copy_(_fill(SEED))
    caches = _views(buf)
    got = region.export(caches)
    assert got is not None
    desc, base, nbytes = got
    geometry = layer_geometry(caches, base, nbytes)
    conn.send({"info": c.get_connection_info()})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        op = msg["op"]
        try:
            if op == "publish":
                hold = region.hold(FROM, TO, msg["key"])
                data = describe_request(
                    msg["key"],
                    msg["blocks"],
                    len(msg["blocks"]) * BS,
                    caches,
                    IDENT,
                    {"region": msg.get("region", desc), "hold": hold, "geometry": geometry},
                    digests=True,
                )
                c.put(FROM, TO, msg["key"], data)
                conn.send({"hold": hold})
            elif op == "released":
                conn.send({"ok": region.released(msg["hold"])})
            elif op == "take_back":
                conn.send({"ok": region.take_back(msg["hold"])})
            elif op == "revoke":  # vLLM preempted the request and freed its blocks
                region.revoke(msg["hold"])
                conn.send({"ok": True})
            elif op == "expire_hold":  # the reader kept them past its lease and grace
                conn.send({"ok": region.expire_hold(msg["hold"])})
            elif op == "scribble":  # rewrite one page of layer 0 after it was described
                page_view(caches[0], IDENT)[msg["block"]].add_(1.0)
                conn.send({"ok": True})
            elif op == "refill":  # the seeded cache again (after a scribble)
                buf.copy_(_fill(SEED))
                conn.send({"ok": True})
            elif op == "sleep_wake":  # vLLM's sleep (the cache overwritten), wake, refill
                region.sleep()
                buf.copy_(_fill(SEED + 1))
                region.wake()
                buf.copy_(_fill(SEED))  # what the engine computes again
                got = region.export(caches)
                assert got is not None
                desc = got[0]
                conn.send({"generation": desc["generation"]})
            elif op == "exit":
                break
        except Exception as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})
    c.close()
    conn.close()


class Producer:
    def __init__(self, backend: str, cfg: dict[str, Any]) -> None:
        self.backend = backend
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, backend, cfg), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._recv(90)["info"]

    def _recv(self, timeout: float = 30) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the producer process did not answer")
        return self.conn.recv()

    def call(self, **msg: Any) -> Any:
        self.conn.send(msg)
        r = self._recv()
        assert "error" not in r, r
        return r

    def stop(self) -> None:
        try:
            self.conn.send({"op": "exit"})
        except OSError:
            pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module", params=ENGINES)
def producer(request: pytest.FixtureRequest) -> Iterator[Producer]:
    engine = request.param
    cfg = CONFIG[engine]("sender", pool_mib=16, register_cache=True, lease_slack_s=0.5)
    p = Producer(engine, cfg)
    try:
        yield p
    finally:
        p.stop()


def _consumer(producer: Producer, **over: Any) -> Any:
    cfg = CONFIG[producer.backend]("receiver", pool_mib=8, register_cache=True, **over)
    c = pull_backend(producer.backend)[0](cfg)
    c.update_sender_info(producer.info["host"], producer.info["zmq_port"])
    return c


def _local_cache(c: Any, registered: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if registered:
        with c.cache_region.allocation_context():
            buf = torch.zeros(LAYERS * LAYER_BYTES, dtype=torch.int8)
    else:
        buf = torch.zeros(LAYERS * LAYER_BYTES, dtype=torch.int8)
    return buf, _views(buf)


def _key() -> str:
    return f"req-{uuid.uuid4().hex[:8]}"


def _copy(c: Any, stream: Any, caches: list[torch.Tensor], dst: list[int], first: int = 0) -> int:
    """What ``SharedPagesPlan.apply`` does: copy the payload's pages under its hold."""
    meta, shared, ids = shared_fields(stream.obj)
    pairs = list(zip(ids[first:], dst[first:], strict=True))
    region = c.cache_region
    with region.reading(shared["hold"]):
        return int(
            region.copy_into(
                shared["region"], shared["geometry"], IDENT, caches, pairs, shared["sums"], first
            )
        )


@pytest.mark.parametrize("registered", [True, False], ids=["direct", "staged"])
def test_pages_are_pulled_from_the_registered_cache(producer: Producer, registered: bool) -> None:
    c = _consumer(producer)
    try:
        buf, caches = _local_cache(c, registered)
        assert c.cache_region._registered_here(caches) is registered
        key = _key()
        hold = producer.call(op="publish", key=key, blocks=SRC)["hold"]
        assert producer.call(op="released", hold=hold)["ok"] is False
        dst = [10, 11, 12, 0, 1, 30, 47]
        stream = c.open_stream(FROM, TO, key)
        assert stream is not None
        with stream:
            frame = stream.size
            assert frame < 16 << 10  # a descriptor, not the pages
            # a consumer holds a live lease: the producer cannot take the blocks back
            assert producer.call(op="take_back", hold=hold)["ok"] is False
            moved = _copy(c, stream, caches, dst, first=1)  # the first page is local already
        assert moved == LAYERS * (len(SRC) - 1) * PAGE
        want = _views(_fill(SEED))
        for w, got in zip(want, caches, strict=True):
            wp, gp = page_view(w, IDENT), page_view(got, IDENT)
            for s, d in list(zip(SRC, dst))[1:]:
                assert torch.equal(gp[d].view(torch.int32), wp[s].view(torch.int32))
        untouched = sorted(set(range(BLOCKS)) - set(dst[1:]))
        for got in caches:
            assert not page_view(got, IDENT)[untouched].view(torch.int32).any()
        # the copy ended the lease: the producer's exposure (the hold) is gone
        assert producer.call(op="released", hold=hold)["ok"] is True
    finally:
        c.close()


@pytest.mark.parametrize("how", ["take_back", "revoke", "expire_hold"])
def test_blocks_taken_back_during_a_copy_fail_it(producer: Producer, how: str) -> None:
    """The producer takes the blocks back while a consumer copies them: once its lease ran
    out (``take_back``), or under a live lease as vLLM gets them back (a preemption:
    ``revoke``; a reader past the handoff's lease and grace: ``expire_hold``). The copy
    fails, never passes, and a late consumer finds nothing."""
    late = how == "take_back"
    c = _consumer(producer, transfer_timeout_s=1.5 if late else 60)  # lease: + 0.5 s slack
    try:
        _buf, caches = _local_cache(c, True)
        key = _key()
        hold = producer.call(op="publish", key=key, blocks=SRC)["hold"]
        stream = c.open_stream(FROM, TO, key)
        assert stream is not None
        with stream:
            assert producer.call(op="take_back", hold=hold)["ok"] is False  # the lease holds
            if late:
                time.sleep(2.5)  # the consumer stalls past its lease
            assert producer.call(op=how, hold=hold)["ok"] is True
            assert producer.call(op="released", hold=hold)["ok"] is True
            with pytest.raises(KVTransferError, match="took back"):
                _copy(c, stream, caches, list(range(len(SRC))))
        assert c.open_stream(FROM, TO, key) is None
    finally:
        c.close()


def test_discard_releases_the_hold(producer: Producer) -> None:
    c = _consumer(producer)
    try:
        key = _key()
        hold = producer.call(op="publish", key=key, blocks=SRC[:2])["hold"]
        assert c.discard(FROM, TO, key) is True
        assert producer.call(op="released", hold=hold)["ok"] is True
    finally:
        c.close()


def test_rewritten_page_fails_its_digest(producer: Producer) -> None:
    c = _consumer(producer)
    try:
        _buf, caches = _local_cache(c, True)
        key = _key()
        producer.call(op="publish", key=key, blocks=SRC)
        producer.call(op="scribble", block=SRC[3])
        stream = c.open_stream(FROM, TO, key)
        assert stream is not None
        with stream, pytest.raises(KVPayloadError, match="layer 0 page 3"):
            _copy(c, stream, caches, list(range(len(SRC))))
    finally:
        c.close()


def test_hostile_descriptors_read_nothing(producer: Producer) -> None:
    c = _consumer(producer)
    try:
        _buf, caches = _local_cache(c, True)
        key = _key()
        producer.call(op="publish", key=key, blocks=SRC)
        stream = c.open_stream(FROM, TO, key)
        assert stream is not None
        with stream:
            _meta, shared, ids = shared_fields(stream.obj)
            region, geo = shared["region"], shared["geometry"]
            pairs = [(s, i) for i, s in enumerate(ids)]
            small = {**region, "size": region["size"] - 1}  # the last layer reaches outside
            bad: list[tuple[Any, Any, list[tuple[int, int]]]] = [
                (small, geo, pairs),
                ({**region, "kind": "shm"}, geo, pairs),
                ({**region, "base": "0x1"}, geo, pairs),
                (region, [[-4, *geo[0][1:]]], pairs),
                (region, geo, [(BLOCKS, 0)]),  # a source page past the producer's cache
                (region, geo, [(0, BLOCKS)]),  # a destination page past ours
            ]
            cr = c.cache_region
            for desc, g, p in bad:
                before = [x.clone() for x in caches]
                with pytest.raises(KVPayloadError):
                    cr.copy_into(desc, g, IDENT, caches, p, None, 0)
                assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    finally:
        c.close()


def test_register_cache_is_off_by_default_and_checked(producer: Producer) -> None:
    from vllm_omni_kv.errors import ConfigError

    cls, config = pull_backend(producer.backend)
    c = cls(config("receiver", pool_mib=4))
    try:
        assert c.cache_region is None
    finally:
        c.close()
    for key in ("register_cache", "verify_pages"):  # refused before an engine starts
        with pytest.raises(ConfigError, match=key):
            cls(config("receiver", pool_mib=4, **{"register_cache": True, key: "yes"}))


@pytest.mark.parametrize("engine", ENGINES)
def test_doctor_selftest_pulls_registered_pages(engine: str) -> None:
    """The ``doctor --selftest`` row of the engine's registered-cache mode passes."""
    import importlib

    from vllm_omni_kv.cli import BACKENDS

    module, _, fn = BACKENDS[f"{engine} (register_cache)"][0].partition(":")
    result = getattr(importlib.import_module(module), fn)()
    assert result["ok"], result


def test_sleep_and_wake_register_the_cache_again(producer: Producer) -> None:
    """vLLM's sleep mode: the producer unregisters its cache, voids its payloads and
    registers the cache again as generation 2. A pull under a lease taken before fails;
    a consumer that had read generation 0 reads generation 2 exactly (NIXL: it loads the
    producer's new registration) and refuses a payload naming generation 0."""
    c = _consumer(producer)
    try:
        producer.call(op="refill")
        _buf, caches = _local_cache(c, True)
        dst = list(range(len(SRC)))
        key = _key()
        producer.call(op="publish", key=key, blocks=SRC)
        with c.open_stream(FROM, TO, key) as stream:
            desc0 = shared_fields(stream.obj)[1]["region"]
            assert _copy(c, stream, caches, dst) == LAYERS * len(SRC) * PAGE
        old = _key()
        producer.call(op="publish", key=old, blocks=SRC)  # never read: voided by the sleep
        leased = _key()
        producer.call(op="publish", key=leased, blocks=SRC)
        stream = c.open_stream(FROM, TO, leased)  # a lease taken before the sleep ...
        assert producer.call(op="sleep_wake")["generation"] == 2
        with stream, pytest.raises(KVTransferError, match="took back"):
            _copy(c, stream, caches, dst)  # ... does not cover a pull after it
        for got in caches:
            got.zero_()
        new = _key()
        producer.call(op="publish", key=new, blocks=SRC)
        with c.open_stream(FROM, TO, new) as stream:
            assert _copy(c, stream, caches, dst) == LAYERS * len(SRC) * PAGE
        want = _views(_fill(SEED))
        for w, got in zip(want, caches, strict=True):
            wp, gp = page_view(w, IDENT), page_view(got, IDENT)
            for s, d in zip(SRC, dst, strict=True):
                assert torch.equal(gp[d].view(torch.int32), wp[s].view(torch.int32))
        assert c.open_stream(FROM, TO, old) is None
        stale = _key()  # a payload naming generation 0 after all
        producer.call(op="publish", key=stale, blocks=SRC, region=desc0)
        before = [x.clone() for x in caches]
        with c.open_stream(FROM, TO, stale) as stream:
            with pytest.raises(KVTransferError, match="generation 0"):
                _copy(c, stream, caches, dst)
        bits = [(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(before, caches)]
        assert all(torch.equal(a, b) for a, b in bits)  # nothing moved (as bits: NaNs too)
    finally:
        c.close()
