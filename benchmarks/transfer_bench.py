"""Transfer-core throughput: pack, unpack, and a producer-KV-cache -> consumer-KV-cache move
through the shared-memory backend across two processes, beside a plain memcpy of the same
bytes measured in the same run (the physical limit of this machine).

    python benchmarks/transfer_bench.py            # 1..256 MiB, writes results/transfer_bench.{json,png}
    python benchmarks/transfer_bench.py --quick    # 4 MiB only, for smoke tests

The KV shape is realistic: 8 layers x 8 KV heads x head size 128, bf16, vLLM 0.32's CPU
paged layout with block size 32 and shuffled block ids; the consumer injects into its own
paged cache. Rows report the median of the timed repeats (after one warm-up); the moves
run in ``--trials`` rounds, each against a memcpy measured just before it.

The cost of the shared secret (``auth_key_file``): pack and unpack of a keyed frame
(keyed BLAKE2b chunk tags and head MAC beside the xxh3 digests) and the default move
with a key on both sides, each against its unkeyed twin of the same trial
(``vs_unkeyed``: keyed bytes/s over unkeyed bytes/s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.transfer.kv_config import DEFAULT_MAX_PART_BYTES, OmniKVCacheConfig
from vllm_omni_kv.transfer.manager import OmniKVTransferManager
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.auth import load_key_file
from vllm_omni_kv.wire.payload import KVCacheTransferData

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


# -- two memcpys at once: what a pipelined two-copy move can reach on this host ------------------


def _copy_worker(nbytes: int, repeats: int, barrier: Any, conn: Any) -> None:
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats + 1):  # both copies start together every round
        barrier.wait()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    conn.send(statistics.median(times[1:]))
    conn.close()


def concurrent_memcpy(nbytes: int, repeats: int) -> float:
    """Median seconds of one memcpy of ``nbytes`` while another process copies as much.

    A streamed move runs two copies at once (the producer packs into shared memory
    while the consumer copies out of it); where both share memory bandwidth, this
    is the pace each copy can keep.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_copy_worker, args=(nbytes, repeats, barrier, w)) for _r, w in pipes
    ]
    for p in procs:
        p.start()
    try:
        out = []
        for r, _w in pipes:
            if not r.poll(120):
                raise RuntimeError("a memcpy worker did not report (see its traceback)")
            out.append(r.recv())
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return max(out)


# -- the two-process shared-memory move --------------------------------------------------------


def _manager(
    ns: str,
    *,
    send: bool,
    max_part_bytes: int | None,
    stream: bool = True,
    auth_key_file: str | None = None,
) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": ns, "stream": stream},
            from_stage="prefill",
            to_stage="decode",
            need_send_cache=send,
            need_recv_cache=not send,
            recv_timeout=60.0,
            # the receiver waits on the critical path: poll tightly (no backoff)
            poll_interval=0.0001,
            max_poll_interval=0.0001,
            max_part_bytes=max_part_bytes,
            auth_key_file=auth_key_file,
        )
    )


def _extract(fmt: str, key: str, ids: list[int], tokens: int, caches: list[torch.Tensor]) -> Any:
    if fmt == "blocks":
        return extract_request_blocks(key, ids, tokens, caches)
    return extract_request_kv(key, ids, tokens, caches)


def _consumer(
    ns: str,
    fmt: str,
    tokens: int,
    repeats: int,
    max_part_bytes: int | None,
    stream: bool,
    auth_key_file: str | None,
    conn_pipe: Any,
) -> None:
    torch.set_num_threads(1)
    caches, ids = _paged_caches(tokens, seed=99)  # the consumer's own cache, other block ids
    mgr = _manager(
        ns, send=False, max_part_bytes=max_part_bytes, stream=stream, auth_key_file=auth_key_file
    )
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
    nbytes_target: int,
    repeats: int,
    fmt: str = "blocks",
    max_part_bytes: int | None = None,
    stream: bool = True,
    auth_key_file: str | None = None,
) -> tuple[float, int]:
    """Median seconds from the producer's extract+send start to the consumer's inject end.

    Both sides run ``OmniKVTransferManager`` (``send_kv_cache`` /
    ``receive_kv_cache_into``) over the shared-memory backend (keyed with
    ``auth_key_file`` when given).
    """
    tokens = _tokens_for(nbytes_target >> 20)
    caches, ids = _paged_caches(tokens, seed=1)
    ns = f"bench{os.getpid()}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (ns, fmt, tokens, repeats, max_part_bytes, stream, auth_key_file, child)
    proc = ctx.Process(target=_consumer, args=args)
    proc.start()
    tx = _manager(
        ns, send=True, max_part_bytes=max_part_bytes, stream=stream, auth_key_file=auth_key_file
    )
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


PAIR_ROW = "memcpy, 2 processes at once (each)"
KEYED_MOVE = "shm move, blocks, streamed, auth key (MAC)"
#: (row, payload format, max_part_bytes, stream, keyed); the first row is the default
#: configuration, and KEYED_MOVE is the same move with an auth key on both sides
MOVES: list[tuple[str, str, int | None, bool, bool]] = [
    ("shm move, blocks, streamed (cache->cache, 2 procs)", "blocks", None, True, False),
    ("shm move, blocks, layer parts, not streamed", "blocks", DEFAULT_MAX_PART_BYTES, False, False),
    ("shm move, blocks, one frame, not streamed", "blocks", 0, False, False),
    ("shm move, tokens, streamed (cache->cache, 2 procs)", "tokens", None, True, False),
    (KEYED_MOVE, "blocks", None, True, True),
]


def _key_file(directory: str) -> str:
    """A fresh 32-byte secret in a private file, as a deployment would configure it."""
    path = os.path.join(directory, "omnikv-bench.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return path


def measure_size(mib: int, repeats: int, trials: int, key_file: str) -> list[dict[str, Any]]:
    """memcpy, pack, unpack and the two-process moves for one payload size.

    The moves run in ``trials`` rounds, each with its own memcpy baseline: this host's
    memory bandwidth drifts by +-20% within minutes, so a move is compared with the
    memcpy measured right before it, and rows report the median over trials.
    """
    tokens = _tokens_for(mib)
    caches, ids = _paged_caches(tokens, seed=1)
    nbytes = tokens * BYTES_PER_TOKEN
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)

    def memcpy() -> float:
        return _median_seconds(lambda: dst.copy_(src), repeats * 2)

    memcpy_s = memcpy()
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
    auth = load_key_file(key_file)
    keyed = codec.encode(extract_request_blocks("r", ids, tokens, caches), None, auth)
    kbuf = bytearray(keyed.nbytes)
    keyed.pack_into(kbuf)
    kpack_s = _median_seconds(lambda: keyed.pack_into(kbuf), repeats)
    kpack = _row("pack blocks (gather+checksum+MAC)", keyed.nbytes, kpack_s, memcpy_s)
    kpack["vs_unkeyed"] = (keyed.nbytes / kpack_s) / (frame.nbytes / pack_s)
    rows.append(kpack)
    kunpack_s = _median_seconds(lambda: codec.decode(kbuf, auth=auth), repeats)
    kunpack = _row("unpack (verify+MAC, views)", keyed.nbytes, kunpack_s, memcpy_s)
    kunpack["vs_unkeyed"] = (keyed.nbytes / kunpack_s) / (frame.nbytes / unpack_s)
    rows.append(kunpack)
    samples: dict[str, list[tuple[float, float, int]]] = {m[0]: [] for m in MOVES}
    pairs: list[tuple[float, float]] = []
    for _ in range(trials):
        base = memcpy()
        pairs.append((concurrent_memcpy(nbytes, repeats * 2), base))
        for path, fmt, part, stream, with_key in MOVES:
            move_s, size = shm_move(
                nbytes,
                repeats,
                fmt,
                max_part_bytes=part,
                stream=stream,
                auth_key_file=key_file if with_key else None,
            )
            samples[path].append((move_s, base, size))
    pair = _row(
        PAIR_ROW,
        nbytes,
        statistics.median(p for p, _ in pairs),
        statistics.median(b for _, b in pairs),
    )
    pair["fraction_of_memcpy"] = statistics.median(b / p for p, b in pairs)
    rows.append(pair)
    line = f"{mib:4d} MiB  memcpy {nbytes / memcpy_s / 1e9:6.2f} GB/s | pack {frame.nbytes / pack_s / 1e9:6.2f}"
    line += f" | 2 memcpys at once: {pair['fraction_of_memcpy']:.0%} each"
    for path, _fmt, part, stream, with_key in MOVES:
        got = samples[path]
        fractions = [b / m for m, b, _ in got]
        move_s = statistics.median(m for m, _, _ in got)
        size = got[0][2]
        row = _row(path, size, move_s, statistics.median(b for _, b, _ in got))
        row["fraction_of_memcpy"] = statistics.median(fractions)
        row["fraction_samples"] = [round(f, 3) for f in fractions]
        # each trial's move against the two-at-once memcpy measured in the same trial
        row["fraction_of_concurrent_memcpy"] = statistics.median(
            p / m for (m, _, _), (p, _) in zip(got, pairs, strict=True)
        )
        row["max_part_bytes"] = part
        row["stream"] = stream
        row["auth_key"] = with_key
        if with_key:  # bytes/s keyed over unkeyed, trial by trial (same memcpy baseline)
            plain = samples[MOVES[0][0]]
            ratios = [
                (sk / k) / (sp / p) for (k, _, sk), (p, _, sp) in zip(got, plain, strict=True)
            ]
            row["vs_unkeyed"] = statistics.median(ratios)
            row["vs_unkeyed_samples"] = [round(r, 3) for r in ratios]
        rows.append(row)
        line += f" | {path.split(' (')[0][10:]}: {row['fraction_of_memcpy']:.0%}"
        line += f" ({min(fractions):.0%}-{max(fractions):.0%})"
    line += f" | keyed/unkeyed: pack {kpack['vs_unkeyed']:.0%}, unpack {kunpack['vs_unkeyed']:.0%}"
    line += f", move {rows[-1]['vs_unkeyed']:.0%}"
    print(line, flush=True)
    return rows


def run(sizes_mib: list[int], repeats: int, trials: int = 3) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # one core per process: the consumer owns the other
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="omnikv-bench-") as tmp:
        key_file = _key_file(tmp)
        for mib in sizes_mib:
            rows += measure_size(mib, repeats, trials, key_file)
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
        mine = [r for r in rows if r.get("path") == p and "gbps" in r]
        pts = sorted((r["size_mib"], r["gbps"]) for r in mine)
        label = p
        ratios = [r["vs_unkeyed"] for r in mine if "vs_unkeyed" in r]
        if ratios:  # the MAC's cost, as keyed bytes/s over unkeyed (median over sizes)
            label += f" [{statistics.median(ratios):.0%} of unkeyed]"
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker="o",
            label=label,
            lw=2.5 if p in ("memcpy", MOVES[0][0], KEYED_MOVE) else 1.5,
            ls="--" if ratios else "-",
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
    ap.add_argument("--trials", type=int, default=3, help="rounds of the shm moves per size")
    ap.add_argument("--quick", action="store_true", help="4 MiB, 3 repeats, 1 trial")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "transfer_bench.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing JSON")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(json.loads(a.out.read_text())["rows"], a.out.with_suffix(".png"))
        return
    sizes, repeats, trials = ([4], 3, 1) if a.quick else (a.sizes, a.repeats, a.trials)
    rows = run(sizes, repeats, trials)
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
        "trials": trials,
        "rows": rows,
    }
    a.out.write_text(json.dumps(result, indent=2))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
