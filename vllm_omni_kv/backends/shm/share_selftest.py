"""Self-test of one-copy page moves (``doctor --selftest``): shm ``share_cache`` and CUDA IPC.

A producer in this process allocates a small KV cache in its backend's region (the way
vLLM does, inside the allocation context), exports it, holds and publishes a
shared-pages payload; a consumer in a spawned process copies the pages into its own
cache under the hold and compares them with the producer's seeded values.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from typing import Any

import torch

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 64, 2, 16, 64
IDS = [3, 4, 5, 9, 1]


def _backend(name: str, ns: str) -> Any:
    from vllm_omni_kv.backends.factory import OmniConnectorFactory
    from vllm_omni_kv.backends.spec import ConnectorSpec

    extra = {"namespace": ns, **({"share_cache": True} if name == "shm" else {})}
    return OmniConnectorFactory.create_connector(ConnectorSpec(name, extra))


def _views(buf: torch.Tensor) -> list[torch.Tensor]:
    per = buf.numel() // LAYERS
    return [
        buf[i * per : (i + 1) * per].view(torch.float16).view(BLOCKS, HEADS, BS, 2 * DIM)
        for i in range(LAYERS)
    ]


def _cache(backend: Any, device: str) -> list[torch.Tensor]:
    nbytes = LAYERS * BLOCKS * HEADS * BS * 2 * DIM * 2
    ctx = backend.cache_region.allocation_context()
    with ctx if ctx is not None else torch.no_grad():
        buf = torch.zeros(nbytes, dtype=torch.int8, device=device)
    return _views(buf)


def _expected(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    shape = (BLOCKS, HEADS, BS, 2 * DIM)
    return [torch.randn(shape, generator=g).half().to(device) for _ in range(LAYERS)]


def _consume(name: str, ns: str, device: str, conn: Any) -> None:
    try:
        from vllm_omni_kv.kvcache.cache_layout import infer_identity
        from vllm_omni_kv.kvcache.shared_pages import shared_fields

        backend = _backend(name, ns)
        mine = _cache(backend, device)
        stream = backend.open_stream("selftest", "consumer", "k")
        if stream is None:
            conn.send("payload not found")
            return
        with stream:
            _m, shared, src = shared_fields(stream.obj)
            region = backend.cache_region
            with region.reading(shared["hold"]):
                region.copy_into(
                    shared["region"],
                    shared["geometry"],
                    infer_identity(mine[0], packing="k_v"),
                    mine,
                    list(zip(src, src, strict=True)),
                    shared["sums"],
                    0,
                )
                if device == "cuda":
                    torch.cuda.synchronize()
        ref = _expected(device)
        same = all(torch.equal(mine[i][b], ref[i][b]) for i in range(LAYERS) for b in IDS)
        backend.close()
        conn.send("ok" if same else "pages differ")
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")


def run(name: str, device: str) -> dict[str, Any]:
    """One page move between this process and a spawned one over backend ``name``."""
    from vllm_omni_kv.backends.shm import arena
    from vllm_omni_kv.kvcache.cache_layout import infer_identity
    from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry
    from vllm_omni_kv.wire import codec

    ns = f"selftest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    backend = _backend(name, ns)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consume, args=(name, ns, device, child), daemon=True)
    try:
        caches = _cache(backend, device)
        for v, ref in zip(caches, _expected(device), strict=True):
            v.copy_(ref)
        region = backend.cache_region
        got = region.export(caches)
        if got is None:
            return {"ok": False, "detail": "the cache was not allocated in the region"}
        desc, base, nbytes = got
        hold = region.hold("selftest", "consumer", "k")
        region.ready(caches)
        shared = {"region": desc, "geometry": layer_geometry(caches, base, nbytes), "hold": hold}
        ident = infer_identity(caches[0], packing="k_v")
        data = describe_request(
            "k", IDS, len(IDS) * BS, caches, ident, shared, digests=region.digests
        )
        backend.put("selftest", "consumer", "k", codec.encode(data))
        proc.start()
        verdict = parent.recv() if parent.poll(120) else "consumer did not answer in 120 s"
        released = region.released(hold)
    finally:
        backend.close()
        if proc.is_alive() or proc.exitcode is None:
            proc.join(10)
        if proc.is_alive():
            proc.kill()
    left = arena.namespace_files(ns)
    ok = verdict == "ok" and released and not left
    ms = (time.perf_counter() - t0) * 1e3
    return {
        "ok": ok,
        "detail": f"{len(IDS)} pages x {LAYERS} layers copied once from another process's cache "
        f"({verdict}; hold released={released}; files left={sorted(left)}) in {ms:.0f} ms",
    }


def selftest() -> dict[str, Any]:
    return run("shm", "cpu")
