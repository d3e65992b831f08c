"""Transfer-core throughput: pack, unpack, and a producer-KV-cache -> consumer-KV-cache move
through the shared-memory backend across two processes, beside a plain memcpy of the same
bytes measured in the same run (the physical limit of this machine).

    python benchmarks/transfer_bench.py            # 1..256 MiB, writes results/transfer_bench.{json,png}
    python benchmarks/transfer_bench.py --quick    # 1 and 4 MiB, for smoke tests

The KV shape is realistic: 8 layers x 8 KV heads x head size 128, bf16, vLLM 0.32's CPU
paged layout with block size 32 and shuffled block ids; the consumer injects into its own
paged cache. Rows report the median of the timed repeats (after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vllm_omni_kv.transfer.extract import extract_request_kv
from vllm_omni_kv.transfer.kv_config import DEFAULT_MAX_PART_BYTES, OmniKVCacheConfig
from vllm_omni_kv.transfer.manager import OmniKVTransferManager
from vllm_omni_kv.transfer.payload import KVCacheTransferData
from vllm_omni_kv.transfer.raw_blocks import extract_request_blocks

LAYERS, HEADS, DIM, BS = 8, 8, 128, 32
DTYPE = torch.bfloat16
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2
RESULTS = Path(__file__).resolve().parent / "results"


def _tokens_for(mib: int) -> int:
    return max(BS, (mib << 20) // BYTES_PER_TOKEN // BS * BS)


def _paged_caches(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    nblocks = tokens // BS + 4
    g = torch.Generator().manual_seed(seed)
    caches = [
        torch.randn(nblocks, HEADS, BS, 2 * DIM, generator=g).to(DTYPE) for _ in range(LAYERS)
    ]
    ids = torch.randperm(nblocks, generator=g)[: tokens // BS].tolist()
    return caches, ids


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(path: str, nbytes: int, seconds: float, memcpy_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "path": path,
        "size_mib": round(nbytes / 2**20, 3),
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "fraction_of_memcpy": memcpy_s / seconds,
        **extra,
    }


# -- the two-process shared-memory move --------------------------------------------------------


def _manager(ns: str, *, send: bool, max_part_bytes: int) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": ns},
            from_stage="prefill",
            to_stage="decode",
            need_send_cache=send,
            need_recv_cache=not send,
            recv_timeout=60.0,
            poll_interval=0.0001,  # the receiver waits on the critical path: poll tightly
            max_part_bytes=max_part_bytes,
        )
    )


def _extract(fmt: str, key: str, ids: list[int], tokens: int, caches: list[torch.Tensor]) -> Any:
    if fmt == "blocks":
        return extract_request_blocks(key, ids, tokens, caches)
    return extract_request_kv(key, ids, tokens, caches)


def _consumer(
    ns: str, fmt: str, tokens: int, repeats: int, max_part_bytes: int, conn_pipe: Any
) -> None:
    torch.set_num_threads(1)
    caches, ids = _paged_caches(tokens, seed=99)  # the consumer's own cache, other block ids
    mgr = _manager(ns, send=False, max_part_bytes=max_part_bytes)
    try:
        for i in range(repeats + 1):
            got = mgr.receive_kv_cache_into(f"req{i}", list(caches), ids)
            if got is None or got[0] != tokens:
                raise RuntimeError(f"round {i}: received {got}, expected {tokens} tokens")
            conn_pipe.send((time.perf_counter(), got[1]))
    finally:
        mgr.close()
        conn_pipe.close()


def shm_move(
    nbytes_target: int, repeats: int, fmt: str = "blocks", max_part_bytes: int = 0
) -> tuple[float, int]:
    """Median seconds from the producer's extract+send start to the consumer's inject end.

    Both sides run ``OmniKVTransferManager`` (``send_kv_cache`` /
    ``receive_kv_cache_into``) over the shared-memory backend.
    """
    tokens = _tokens_for(nbytes_target >> 20)
    caches, ids = _paged_caches(tokens, seed=1)
    ns = f"bench{os.getpid()}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(ns, fmt, tokens, repeats, max_part_bytes, child))
    proc.start()
    tx = _manager(ns, send=True, max_part_bytes=max_part_bytes)
    times = []
    size = 0
    try:
        for i in range(repeats + 1):
            time.sleep(0.05)  # let the consumer reach its polling loop
            t0 = time.perf_counter()
            if not tx.send_kv_cache(f"req{i}", _extract(fmt, f"req{i}", ids, tokens, caches)):
                raise RuntimeError(f"round {i}: send failed")
            if not parent.poll(60):
                raise RuntimeError("the consumer process did not report (see its traceback)")
            t_done, size = parent.recv()
            if i:  # the first round allocates the arena: warm-up
                times.append(t_done - t0)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        tx.close()
    return statistics.median(times), size


def measure_size(mib: int, repeats: int) -> list[dict[str, Any]]:
    """memcpy, pack, unpack and the two-process move for one payload size."""
    tokens = _tokens_for(mib)
    caches, ids = _paged_caches(tokens, seed=1)
    nbytes = tokens * BYTES_PER_TOKEN
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy_s = _median_seconds(lambda: dst.copy_(src), repeats * 2)
    rows = [_row("memcpy", nbytes, memcpy_s, memcpy_s)]
    frame = extract_request_blocks("r", ids, tokens, caches).frame()
    buf = bytearray(frame.nbytes)
    frame.pack_into(buf)
    pack_s = _median_seconds(lambda: frame.pack_into(buf), repeats)
    rows.append(_row("pack blocks (gather+checksum)", frame.nbytes, pack_s, memcpy_s))
    unpack_s = _median_seconds(lambda: KVCacheTransferData.from_bytes(buf), repeats)
    rows.append(_row("unpack (verify, views)", frame.nbytes, unpack_s, memcpy_s))
    unpack_nv = _median_seconds(lambda: KVCacheTransferData.from_bytes(buf, verify=False), repeats)
    rows.append(_row("unpack (no verify, views)", frame.nbytes, unpack_nv, memcpy_s))
    part = DEFAULT_MAX_PART_BYTES
    one_s, one_size = shm_move(nbytes, repeats, "blocks", max_part_bytes=0)
    rows.append(
        _row("shm move, blocks, one frame (cache->cache, 2 procs)", one_size, one_s, memcpy_s)
    )
    move_s, size = shm_move(nbytes, repeats, "blocks", max_part_bytes=part)
    rows.append(
        _row("shm move, blocks, layer parts (cache->cache, 2 procs)", size, move_s, memcpy_s)
    )
    tok_s, tok_size = shm_move(nbytes, repeats, "tokens", max_part_bytes=part)
    rows.append(
        _row("shm move, tokens, layer parts (cache->cache, 2 procs)", tok_size, tok_s, memcpy_s)
    )
    print(
        f"{mib:4d} MiB  memcpy {nbytes / memcpy_s / 1e9:6.2f} GB/s | pack {frame.nbytes / pack_s / 1e9:6.2f}"
        f" | unpack {frame.nbytes / unpack_s / 1e9:6.2f} | shm move blocks: one frame"
        f" {memcpy_s / one_s:.0%}, parts {size / move_s / 1e9:6.2f} GB/s = {memcpy_s / move_s:.0%}"
        f" of memcpy | tokens {tok_size / tok_s / 1e9:6.2f} GB/s",
        flush=True,
    )
    return rows


def run(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # one core per process: the consumer owns the other
    rows: list[dict[str, Any]] = []
    for mib in sizes_mib:
        rows += measure_size(mib, repeats)
    return rows


def _extra_backends(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    """Mooncake rows from ``bench_backends`` (skipped with a note when Mooncake is absent)."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_backends  # type: ignore[import-not-found]
    except ImportError as e:
        print(f"(mooncake rows skipped: {e})")
        return []
    try:
        rows: list[dict[str, Any]] = bench_backends.run_mooncake(sizes_mib, repeats)
        return rows
    except Exception as e:  # report, do not hide
        print(f"(mooncake rows failed: {type(e).__name__}: {e})")
        return [{"path": "mooncake", "error": f"{type(e).__name__}: {e}"}]


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.2))
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    # zero-copy decoding without verification costs ~nothing: it would only flatten the plot
    paths = sorted(
        {r["path"] for r in rows if "gbps" in r and "no verify" not in r["path"]},
        key=lambda p: (p != "memcpy", p),
    )
    for p in paths:
        pts = sorted((r["size_mib"], r["gbps"]) for r in rows if r.get("path") == p and "gbps" in r)
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker="o",
            label=p,
            lw=2.5 if p == "memcpy" else 1.5,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("vllm-omni-kv transfer core vs memcpy (same run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="1 and 4 MiB, 3 repeats")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "transfer_bench.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing JSON")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(json.loads(a.out.read_text())["rows"], a.out.with_suffix(".png"))
        return
    sizes, repeats = ([1, 4], 3) if a.quick else (a.sizes, a.repeats)
    rows = run(sizes, repeats)
    if not a.no_mooncake:
        rows += _extra_backends(sizes, repeats)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "transfer_bench",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "kv_shape": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": DIM,
            "block_size": BS,
            "dtype": str(DTYPE),
        },
        "repeats": repeats,
        "rows": rows,
    }
    a.out.write_text(json.dumps(result, indent=2))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
