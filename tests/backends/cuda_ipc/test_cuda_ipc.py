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
import uuid
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError

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


def _producer(name: str, ns: str, device: str, seed: int, conn: Any) -> None:
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


def _consumer(name: str, ns: str, device: str, seed: int, conn: Any) -> None:
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
    device = "cuda" if name == "cuda_ipc" else "cpu"
    ns = f"pytest-ipc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=_run_producer, args=(name, ns, device, 7, p_child))
    cons = ctx.Process(target=_run_consumer, args=(name, ns, device, 7, c_child))
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
        from vllm_omni_kv.backends.shm import arena

        arena.sweep_orphans()
        assert not arena.namespace_files(ns), arena.namespace_files(ns)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a host without CUDA")
def test_cuda_ipc_without_a_gpu_says_what_to_use() -> None:
    with pytest.raises(BackendUnavailable, match="share_cache"):
        _backend("cuda_ipc", f"pytest-ipc-{uuid.uuid4().hex[:8]}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_ipc_refuses_a_gpu_this_process_cannot_see() -> None:
    from vllm_omni_kv.backends.cuda_ipc.region import local_device

    with pytest.raises(KVTransferError, match="CUDA_VISIBLE_DEVICES"):
        local_device("GPU-00000000-0000-0000-0000-000000000000")
