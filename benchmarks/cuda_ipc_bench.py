"""CUDA IPC one-copy move: a consumer process copies a request's KV pages GPU to GPU out of the
producer's exported cache, beside a plain device-to-device copy of the same bytes in the
same consumer process (the physical limit of this GPU), measured in the same run.

    python benchmarks/cuda_ipc_bench.py                    # GPU: --backend cuda_ipc --device cuda
    python benchmarks/cuda_ipc_bench.py --backend shm --device cpu --sizes 4   # harness check

Run by ``make gpu-check`` (JSON into ``$(GPU_OUT)``). Shape: 8 layers x 8 KV heads x head
size 128, bf16, FlashAttention-style K|V per token, 16-token blocks; the request's pages
are the first half of a shuffled block table (runs of consecutive blocks are short, as
in a long-running server). A move is timed in the consumer from opening the payload to
the copied pages being on its device (synchronized), hold taken and released.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.kvcache.cache_layout import infer_identity
from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry, shared_fields
from vllm_omni_kv.wire import codec

LAYERS, HEADS, BS, DIM = 8, 8, 16, 128
PAGE = HEADS * BS * 2 * DIM * 2  # bytes of one page of one layer (bf16)
RESULTS = Path(__file__).resolve().parent / "results"


def _backend(name: str, ns: str) -> Any:
    extra = {"namespace": ns, **({"share_cache": True} if name == "shm" else {})}
    return OmniConnectorFactory.create_connector(ConnectorSpec(name, extra))


def _cache(backend: Any, nblocks: int, device: str) -> list[torch.Tensor]:
    per = nblocks * PAGE
    ctx = backend.cache_region.allocation_context()
    with ctx if ctx is not None else torch.no_grad():
        buf = torch.zeros(LAYERS * per, dtype=torch.int8, device=device)
    return [
        buf[i * per : (i + 1) * per].view(torch.bfloat16).view(nblocks, HEADS, BS, 2 * DIM)
        for i in range(LAYERS)
    ]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _consumer(name: str, ns: str, nblocks: int, device: str, conn: Any) -> None:
    backend = _backend(name, ns)
    mine = _cache(backend, nblocks, device)
    ident = infer_identity(mine[0], packing="k_v")
    region = backend.cache_region
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        if cmd[0] == "baseline":  # one contiguous copy of the same bytes on this device
            n = cmd[1]
            src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
            dst = torch.empty_like(src)
            dst.copy_(src)
            _sync(device)
            times = []
            for _ in range(cmd[2]):
                t0 = time.perf_counter()
                dst.copy_(src)
                _sync(device)
                times.append(time.perf_counter() - t0)
            conn.send(statistics.median(times))
            continue
        key, dst_ids = cmd[1], cmd[2]
        t0 = time.perf_counter()
        stream = backend.open_stream("bench", "consumer", key)
        assert stream is not None
        with stream:
            _m, shared, src_ids = shared_fields(stream.obj)
            with region.reading(shared["hold"]):
                moved = region.copy_into(
                    shared["region"],
                    shared["geometry"],
                    ident,
                    mine,
                    list(zip(src_ids, dst_ids, strict=True)),
                    shared["sums"],
                    0,
                )
                _sync(device)
        conn.send((time.perf_counter() - t0, moved))
    backend.close()


def measure(name: str, device: str, mib: int, repeats: int) -> dict[str, Any]:
    used = max(1, (mib << 20) // (PAGE * LAYERS))
    nblocks = 2 * used
    ns = f"bench-ipc-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    backend = _backend(name, ns)
    caches = _cache(backend, nblocks, device)
    for c in caches:
        c.normal_()
    region = backend.cache_region
    got = region.export(caches)
    assert got is not None, "the cache was not allocated in the backend's region"
    desc, base, nbytes = got
    geometry = layer_geometry(caches, base, nbytes)
    ident = infer_identity(caches[0], packing="k_v")
    g = torch.Generator().manual_seed(mib)
    src_ids = torch.randperm(nblocks, generator=g)[:used].tolist()
    dst_ids = torch.randperm(nblocks, generator=g)[:used].tolist()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(name, ns, nblocks, device, child))
    proc.start()
    try:
        moves: list[float] = []
        moved = 0
        for i in range(repeats + 1):  # the first move maps the region: a warm-up
            key = f"k{i}"
            hold = region.hold("bench", "consumer", key)
            region.ready(caches)
            shared = {"region": desc, "geometry": geometry, "hold": hold}
            data = describe_request(
                key, src_ids, used * BS, caches, ident, shared, digests=region.digests
            )
            backend.put("bench", "consumer", key, codec.encode(data))
            parent.send(("move", key, dst_ids))
            seconds, moved = parent.recv()
            assert region.released(hold)
            if i:
                moves.append(seconds)
        parent.send(("baseline", moved, repeats))
        base_s = parent.recv()
        parent.send(("exit",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        backend.close()
    move_s = statistics.median(moves)
    return {
        "backend": name,
        "device": device,
        "mib": mib,
        "bytes": moved,
        "move_ms": round(move_s * 1e3, 3),
        "move_gbps": round(moved / move_s / 1e9, 2),
        "baseline": "device-to-device copy" if device == "cuda" else "memcpy (torch copy_)",
        "baseline_ms": round(base_s * 1e3, 3),
        "baseline_gbps": round(moved / base_s / 1e9, 2),
        "vs_baseline": round(base_s / move_s, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda_ipc", choices=["cuda_ipc", "shm"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_ipc_bench.json")
    a = ap.parse_args(argv)
    rows = [measure(a.backend, a.device, mib, a.repeats) for mib in a.sizes]
    for r in rows:
        print(
            f"{r['mib']:>4} MiB  move {r['move_ms']:8.3f} ms ({r['move_gbps']:6.2f} GB/s)  "
            f"{r['baseline']} {r['baseline_ms']:8.3f} ms ({r['baseline_gbps']:6.2f} GB/s)  "
            f"{100 * r['vs_baseline']:.0f}%"
        )
    machine = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
        "loadavg_1m": os.getloadavg()[0],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
