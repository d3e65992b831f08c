"""One-copy page moves between two processes: CUDA IPC on a GPU, shared memory on the host.

The same protocol runs on both: the producer allocates a vLLM-shaped KV cache inside its
region's allocation context (one int8 ``torch.zeros`` viewed per layer, as vLLM's
``allocate_kv_cache`` does), exports it, holds and publishes a shared-pages payload;
a consumer in another process copies the pages into its own cache under the hold.
Expected pages are regenerated from the producer's seed in the consumer (an
independent reference). ``shm`` runs everywhere; ``cuda_ipc`` needs a CUDA device
(``make gpu-check``); on a host without one, only its clear refusal is checked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.cuda_ipc.region import CudaIpcRegion
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.liveness import HEARTBEAT_S
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.testing.fake_streams import RecordingStreams

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 48, 2, 16, 64  # 1.2 MB: a region allocation
SRC_IDS = [5, 6, 7, 12, 2, 3]  # two runs and a jump, as a block table gives them
DST_IDS = [9, 10, 11, 0, 1, 20]
HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    "shm",
    pytest.param("cuda_ipc", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")),
]


def _backend(name: str, ns: str) -> Any:
    extra = {"namespace": ns, **({"share_cache": True} if name == "shm" else {})}
    return OmniConnectorFactory.create_connector(ConnectorSpec(name, extra))


def _cache(backend: Any, device: str, seed: int | None) -> list[torch.Tensor]:
    """vLLM-like per-layer views ``[blocks, heads, bs, 2*dim]`` of one int8 allocation."""
    per_layer = BLOCKS * HEADS * BS * 2 * DIM * 2  # bf16
    ctx = backend.cache_region.allocation_context()
    with ctx if ctx is not None else torch.no_grad():
        buf = torch.zeros(LAYERS * per_layer, dtype=torch.int8, device=device)
    views = [
        buf[i * per_layer : (i + 1) * per_layer]
        .view(torch.bfloat16)
        .view(BLOCKS, HEADS, BS, 2 * DIM)
        for i in range(LAYERS)
    ]
    if seed is not None:
        for v, ref in zip(views, _reference(seed, device), strict=True):
            v.copy_(ref)
    return views


def _reference(seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, HEADS, BS, 2 * DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]


def _reporting(fn: Any) -> Any:
    """Run a child's body; send the exception back instead of leaving the parent waiting."""

    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:
            args[-1].send(("error", f"{type(e).__name__}: {e}"))
            raise

    run.__name__ = fn.__name__
    return run


def _see(visible: str | None) -> None:
    """Restrict a child to GPU ``visible`` (before it initializes CUDA)."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _producer(name: str, ns: str, device: str, seed: int, visible: str | None, conn: Any) -> None:
    _see(visible)
    from vllm_omni_kv.kvcache.cache_layout import infer_identity
    from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry
    from vllm_omni_kv.wire import codec

    backend = _backend(name, ns)
    caches = _cache(backend, device, seed)
    region = backend.cache_region
    region.check_placement(caches)  # cuda_ipc: inside the private pool's segments
    desc, base, nbytes = region.export(caches)
    geometry = layer_geometry(caches, base, nbytes)
    ident = infer_identity(caches[0], packing="k_v")
    hold = region.hold("p", "d", "req")
    region.ready(caches)
    data = describe_request(
        "req",
        SRC_IDS,
        len(SRC_IDS) * BS - 3,
        caches,
        ident,
        {"region": desc, "geometry": geometry, "hold": hold},
        digests=region.digests,
    )
    backend.put("p", "d", "req", codec.encode(data))
    conn.send(("published", hold))
    conn.recv()  # the consumer copied
    conn.send(("released", region.released(hold)))
    conn.recv()
    backend.close()


def _consumer(name: str, ns: str, device: str, seed: int, visible: str | None, conn: Any) -> None:
    _see(visible)
    from vllm_omni_kv.kvcache.cache_layout import infer_identity
    from vllm_omni_kv.kvcache.shared_pages import shared_fields

    backend = _backend(name, ns)
    mine = _cache(backend, device, None)
    ident = infer_identity(mine[0], packing="k_v")
    stream = backend.open_stream("p", "d", "req")
    assert stream is not None
    with stream:
        _meta, shared, src = shared_fields(stream.obj)
        region = backend.cache_region
        with region.reading(shared["hold"]):
            moved = region.copy_into(
                shared["region"],
                shared["geometry"],
                ident,
                mine,
                list(zip(src, DST_IDS, strict=True)),
                shared["sums"],
                0,
            )
            if device == "cuda":
                torch.cuda.synchronize()
    ref = _reference(seed, device)
    ok = all(
        torch.equal(mine[i][d], ref[i][s])
        for i in range(LAYERS)
        for s, d in zip(SRC_IDS, DST_IDS, strict=True)
    )
    untouched = all(
        not mine[i][b].any() for i in range(LAYERS) for b in range(BLOCKS) if b not in DST_IDS
    )
    conn.send((ok, untouched, moved))
    backend.close()


def _run_producer(*args: Any) -> None:
    _reporting(_producer)(*args)


def _run_consumer(*args: Any) -> None:
    _reporting(_consumer)(*args)


@pytest.mark.parametrize("name", BACKENDS)
def test_pages_move_between_processes_under_a_hold(name: str) -> None:
    _move_pages(name, None, None)


def _move_pages(name: str, producer_gpu: str | None, consumer_gpu: str | None) -> None:
    """Producer and consumer processes (each restricted to its GPU when named); the
    consumer copies the request's pages under the hold."""
    device = "cuda" if name == "cuda_ipc" else "cpu"
    ns = f"pytest-ipc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=_run_producer, args=(name, ns, device, 7, producer_gpu, p_child))
    cons = ctx.Process(target=_run_consumer, args=(name, ns, device, 7, consumer_gpu, c_child))
    prod.start()
    try:
        assert p_conn.poll(120), "producer did not publish"
        got = p_conn.recv()
        assert got[0] == "published", got
        cons.start()
        assert c_conn.poll(120), "consumer did not report"
        got = c_conn.recv()
        assert got[0] != "error", got
        ok, untouched, moved = got
        assert ok, "copied pages differ from the producer's"
        assert untouched, "pages outside the request were written"
        page = HEADS * BS * 2 * DIM * 2
        assert moved == LAYERS * len(SRC_IDS) * page
        p_conn.send("copied")
        assert p_conn.poll(60)
        assert p_conn.recv() == ("released", True)
        p_conn.send("exit")
        prod.join(60)
        cons.join(60)
        assert prod.exitcode == 0 and cons.exitcode == 0
    finally:
        for p in (prod, cons):
            if p.is_alive():
                p.kill()
                p.join(10)

        arena.sweep_orphans()
        assert not arena.namespace_files(ns), arena.namespace_files(ns)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a host without CUDA")
def test_cuda_ipc_without_a_gpu_says_what_to_use() -> None:
    with pytest.raises(BackendUnavailable, match="share_cache"):
        _backend("cuda_ipc", f"pytest-ipc-{uuid.uuid4().hex[:8]}")


# -- the consumer's handles (issue 24, item 4) -----------------------------------------------
class _Producer:
    """A producer's heartbeat segment and a host allocation standing for its exported cache
    (what a consumer's opener maps), with the cache's layer views over it."""

    def __init__(self, ns: str, seed: int) -> None:
        from vllm_omni_kv.kvcache.cache_layout import infer_identity
        from vllm_omni_kv.kvcache.shared_pages import layer_geometry

        self.arena = ProducerArena(0, namespace=ns)
        self.region = CudaIpcRegion(ns, self.arena, arena.STALE_S)
        per_layer = BLOCKS * HEADS * BS * 2 * DIM * 2
        self.alloc = torch.zeros(LAYERS * per_layer, dtype=torch.uint8)
        self.views = [
            self.alloc[i * per_layer : (i + 1) * per_layer]
            .view(torch.bfloat16)
            .view(BLOCKS, HEADS, BS, 2 * DIM)
            for i in range(LAYERS)
        ]
        for v, ref in zip(self.views, _reference(seed, "cpu"), strict=True):
            v.copy_(ref)
        self.ident = infer_identity(self.views[0], packing="k_v")
        self.geometry = layer_geometry(self.views, self.alloc.data_ptr(), self.alloc.numel())
        self.handle = uuid.uuid4().bytes
        self.desc = {
            "kind": "cuda_ipc",
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",  # a GPU no process here sees
            "owner": self.arena.instance,
            "name": self.region.owner_segment(),
            "handle": self.handle,
            "size": self.alloc.numel(),
            "offset": 0,
            "ref_counter_handle": b"r",
            "ref_counter_offset": 0,
            "event_handle": b"e",
            "event_sync_required": False,
        }

    def close(self) -> None:
        self.region.close()
        self.arena.close()


class _Opener:
    """Opens a producer's handle by handing out its host allocation; notes the device."""

    def __init__(self, producers: list[_Producer]) -> None:
        self.by_handle = {p.handle: p.alloc for p in producers}
        self.devices: list[torch.device] = []

    def __call__(self, device: torch.device, fields: Any) -> torch.Tensor:
        self.devices.append(device)
        return self.by_handle[bytes(fields[0])]


def _copy(consumer: CudaIpcRegion, p: _Producer, mine: list[torch.Tensor]) -> int:
    return consumer.copy_into(
        p.desc, p.geometry, p.ident, mine, list(zip(SRC_IDS, DST_IDS, strict=True)), None, 0
    )


@pytest.fixture
def ipc_ns() -> Iterator[str]:
    ns = f"pytest-ipc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield ns
    arena.sweep_orphans()
    assert not arena.namespace_files(ns), arena.namespace_files(ns)


def test_handles_open_on_the_consumers_cache_device(ipc_ns: str) -> None:
    """The producer's GPU is one this consumer cannot see (disjoint CUDA_VISIBLE_DEVICES):
    the handle is opened on the device of the consumer's own cache, once, and the pages
    are copied from it."""
    prod = _Producer(ipc_ns, seed=11)
    opener = _Opener([prod])
    consumer = CudaIpcRegion(ipc_ns, ProducerArena(0, namespace=ipc_ns), arena.STALE_S, opener)
    try:
        mine = [torch.zeros_like(v) for v in prod.views]
        page = HEADS * BS * 2 * DIM * 2
        assert _copy(consumer, prod, mine) == LAYERS * len(SRC_IDS) * page
        assert _copy(consumer, prod, mine) == LAYERS * len(SRC_IDS) * page
        assert opener.devices == [mine[0].device]  # opened once, on the cache's device
        ref = _reference(11, "cpu")
        for i in range(LAYERS):
            for s, d in zip(SRC_IDS, DST_IDS, strict=True):
                assert torch.equal(mine[i][d], ref[i][s])
        assert consumer.mapped_producers() == {prod.arena.instance}
    finally:
        consumer.close()
        consumer.producer.close()
        prod.close()


def test_a_load_of_two_parts_checks_the_producer_once_and_is_one_move(
    ipc_ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two layer groups (two parts) of one load: the producer's heartbeat segment is read
    once, and the pages move on one side stream, 2 operations per layer, nothing per page."""
    from vllm_omni_kv.kvcache.shared_pages import PageCopy

    prod = _Producer(ipc_ns, seed=5)
    consumer = CudaIpcRegion(
        ipc_ns, ProducerArena(0, namespace=ipc_ns), arena.STALE_S, _Opener([prod])
    )
    reads: list[str] = []
    real = arena.read_header
    monkeypatch.setattr(arena, "read_header", lambda name: reads.append(name) or real(name))
    try:
        mine = [torch.zeros_like(v) for v in prod.views]
        a = list(zip(SRC_IDS, DST_IDS, strict=True))
        b = [(40, 30), (1, 2)]
        parts = [
            PageCopy(prod.geometry[:2], prod.ident, mine[:2], a, None, 0),
            PageCopy(prod.geometry[2:], prod.ident, mine[2:], b, None, 0),
        ]
        with device_order.installed("cpu", RecordingStreams()) as fake:
            assert isinstance(fake, RecordingStreams)
            moved = consumer.copy_all(prod.desc, parts, wait=True)
        assert reads == [prod.desc["name"]]
        (side,) = [x for x in fake.side_streams() if x.ops]
        assert len(fake.queued(side, "index_copy_")) == LAYERS
        assert len(fake.queued(side, "index_select")) == LAYERS
        assert len(fake.host_waits) == 1
        page = HEADS * BS * 2 * DIM * 2
        assert moved == (2 * len(a) + len(b)) * page
        ref = _reference(5, "cpu")
        for i in range(LAYERS):
            for s, d in a if i < 2 else b:
                assert torch.equal(mine[i][d], ref[i][s])
    finally:
        consumer.close()
        consumer.producer.close()
        prod.close()


def test_a_dead_producers_handle_is_closed_once_its_copies_ran(ipc_ns: str) -> None:
    """A producer that died keeps no mapping in a live consumer (its GPU memory would stay
    allocated): the next copy from another producer closes it, except while a copy out
    of it may still run (its event not complete yet)."""
    a, b = _Producer(ipc_ns, seed=1), _Producer(ipc_ns, seed=2)
    consumer = CudaIpcRegion(
        ipc_ns, ProducerArena(0, namespace=ipc_ns), arena.STALE_S, _Opener([a, b])
    )
    fake = RecordingStreams()
    try:
        mine = [torch.zeros_like(v) for v in a.views]
        with device_order.installed("cpu", fake):
            _copy(consumer, a, mine)
            a_copied = fake.events[-1]  # recorded after the copy out of a's allocation
            _copy(consumer, b, mine)
            assert consumer.mapped_producers() == {a.arena.instance, b.arena.instance}
            a.close()  # a's heartbeat segment is gone: a is dead
            a_copied.done = False  # its copy still queued on the device
            assert consumer.drop_dead_producers() == 0
            assert consumer.mapped_producers() == {a.arena.instance, b.arena.instance}
            a_copied.done = True
            time.sleep(HEARTBEAT_S)  # a copy sweeps at most once per heartbeat
            _copy(consumer, b, mine)
        assert consumer.mapped_producers() == {b.arena.instance}
        with pytest.raises(KVTransferError, match="gone"):
            _copy(consumer, a, mine)
    finally:
        consumer.close()
        consumer.producer.close()
        b.close()


def test_sleep_refuses_the_old_generation_and_releases_the_handles(ipc_ns: str) -> None:
    """vLLM's sleep mode: the producer's owner segment names generation 1 while asleep,
    2 once awake; a payload of generation 0 is refused before any page moves, one of
    generation 2 is copied. A consumer's sleep closes the handles it opened."""
    prod = _Producer(ipc_ns, seed=3)
    consumer = CudaIpcRegion(
        ipc_ns, ProducerArena(0, namespace=ipc_ns), arena.STALE_S, _Opener([prod])
    )
    try:
        mine = [torch.zeros_like(v) for v in prod.views]
        _copy(consumer, prod, mine)  # generation 0 (a descriptor without one names 0)
        for m in mine:
            m.zero_()
        prod.region.sleep()
        with pytest.raises(KVTransferError, match="generation 0.*asleep"):
            _copy(consumer, prod, mine)
        prod.region.wake()
        with pytest.raises(KVTransferError, match="generation 0.*generation 2"):
            _copy(consumer, prod, mine)
        assert not any(m.any() for m in mine)  # nothing moved
        prod.desc["generation"] = 2
        _copy(consumer, prod, mine)
        ref = _reference(3, "cpu")
        for i in range(LAYERS):
            for s, d in zip(SRC_IDS, DST_IDS, strict=True):
                assert torch.equal(mine[i][d], ref[i][s])
        assert consumer.mapped_producers() == {prod.arena.instance}
        consumer.sleep()
        assert consumer.mapped_producers() == set()
    finally:
        consumer.close()
        consumer.producer.close()
        prod.close()


two_gpus_with_peer_access = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(1, 0),
    reason="needs two CUDA devices with peer access",
)


@pytest.mark.gpu
@two_gpus_with_peer_access
def test_cuda_consumer_on_its_own_gpu_copies_from_a_producer_it_cannot_see() -> None:
    """Two servers on disjoint CUDA_VISIBLE_DEVICES (each sees one GPU, as ``cuda:0``):
    the consumer opens the producer's handle on its own GPU and copies the pages."""
    _move_pages("cuda_ipc", "0", "1")


def _exporter(ns: str, nbytes: int, conn: Any) -> None:
    """A producer process exporting an ``nbytes`` cache (page 5 of it filled with 1.5);
    it sends what a payload carries and waits to be killed."""
    from vllm_omni_kv.kvcache.cache_layout import infer_identity
    from vllm_omni_kv.kvcache.shared_pages import layer_geometry

    backend = _backend("cuda_ipc", ns)
    region = backend.cache_region
    with region.allocation_context():
        buf = torch.zeros(nbytes, dtype=torch.int8, device="cuda")
    views = [buf.view(torch.bfloat16).view(-1, HEADS, BS, 2 * DIM)]
    views[0][5].fill_(1.5)
    torch.cuda.synchronize()
    desc, base, n = region.export(views)
    conn.send((desc, layer_geometry(views, base, n), infer_identity(views[0], packing="k_v")))
    conn.recv()


def _run_exporter(*args: Any) -> None:
    _reporting(_exporter)(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_a_killed_producers_memory_is_given_back_by_the_consumer(ipc_ns: str) -> None:
    """A consumer that copied from a producer which was then killed closes its handle
    (the next sweep), so the producer's GPU memory is freed while the consumer lives."""
    nbytes = 1 << 30
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    prod = ctx.Process(target=_run_exporter, args=(ipc_ns, nbytes, child))
    prod.start()
    consumer = CudaIpcRegion(ipc_ns, ProducerArena(0, namespace=ipc_ns), arena.STALE_S)
    try:
        assert conn.poll(120), "the producer did not export"
        got = conn.recv()
        assert got[0] != "error", got
        desc, geometry, ident = got
        mine = [torch.zeros(8, HEADS, BS, 2 * DIM, dtype=torch.bfloat16, device="cuda")]
        consumer.copy_into(desc, geometry, ident, mine, [(5, 0)], None, 0)
        torch.cuda.synchronize()
        assert bool((mine[0][0] == 1.5).all()) and not mine[0][1:].any()
        assert consumer.mapped_producers() == {desc["owner"]}
        mapped_free = torch.cuda.mem_get_info()[0]
        prod.kill()
        prod.join(30)
        assert consumer.drop_dead_producers() == 1
        assert consumer.mapped_producers() == set()
        deadline = time.monotonic() + 20
        while torch.cuda.mem_get_info()[0] < mapped_free + nbytes * 0.9:
            assert time.monotonic() < deadline, "the killed producer's memory stayed allocated"
            time.sleep(0.2)
    finally:
        consumer.close()
        consumer.producer.close()
        if prod.is_alive():
            prod.kill()
            prod.join(10)
