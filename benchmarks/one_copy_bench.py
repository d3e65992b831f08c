"""One-copy move on one host: the consumer copies a request's pages straight out of the
producer's KV cache (``share_cache``), beside a memcpy of the same bytes and the two-copy
shared-memory move, all measured in the same run.

    python benchmarks/one_copy_bench.py            # 1..256 MiB, writes results/one_copy_bench.{json,png}
    python benchmarks/one_copy_bench.py --quick    # 4 MiB only, for smoke tests

KV shape and method as ``transfer_bench.py`` (8 layers x 8 KV heads x head 128, bf16, vLLM's
CPU paged layout allocated inside ``get_mem_pool_context`` as vLLM does, block size 32,
shuffled block ids). The producer process creates a hold and puts the ``describe_request``
payload per move, as ``connector/worker.py`` does; the consumer process (its own cache in its
own region) times ``open_stream`` -> ``SharedPagesPlan.apply`` -> close, each move against a
memcpy (``memmove`` between pre-faulted buffers) run just before it, and against the same
memcpy run (after the move) with the caches evicted first (a move's pages are scattered over a cache far larger
than the move, so they are rarely in the CPU's caches; below 16 MiB the first memcpy's are). The producer adds page
digests only for the ``verify`` row (``verify_pages``); the default rows carry none, as by
default. A ``fallback`` row runs the same move without the native page copy (the Python
``memmove`` loop of an install that could not compile it). A ``profile`` row times each step
alone, including a streaming-store copy of the same contiguous bytes (what the native copy
does per page run), reported beside memcpy as a second reference, and the page copies with
cached stores (what ``page_copy.STREAM_MIN_BYTES`` decides against from 1 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bench import _row, shm_move  # noqa: E402

from vllm_omni_kv.backends.shm import arena  # noqa: E402
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector  # noqa: E402
from vllm_omni_kv.kvcache import movers, page_copy  # noqa: E402
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view  # noqa: E402
from vllm_omni_kv.kvcache.shared_pages import (  # noqa: E402
    attach_layers,
    copy_pages,
    describe_request,
    layer_geometry,
    page_sums,
)
from vllm_omni_kv.kvcache.shared_pages_plan import SharedPagesPlan  # noqa: E402

LAYERS, HEADS, DIM, BS = 8, 8, 128, 32
DTYPE = torch.bfloat16
PAGE_BYTES = HEADS * BS * 2 * DIM * 2  # one block of one layer (128 KiB)
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2
RESULTS = Path(__file__).resolve().parent / "results"
EDGE = ("prefill", "decode")
#: vLLM 0.32's CPU attention cache (K transposed then V per block and head)
IDENT = KVLayoutId("kt_v", "LBHNC", "bfloat16", BS, BS, HEADS, DIM, 2, "CPU_ATTN")
ONE_COPY = "one-copy move (share_cache), verify"
ONE_COPY_NV = "one-copy move (share_cache), no verify"
TWO_COPY = "two-copy shm move (blocks, streamed)"
FALLBACK = "one-copy move, no native copy (memmove loop), no verify"
STREAM = "streaming-store copy of the same bytes (contiguous)"
BARE = "bare page copies (memmove loop, same pairs)"
PIECES = "memcpy in page-sized pieces (contiguous)"
COLD = "memcpy, caches evicted first"


def _connector(ns: str, verify: bool = True) -> SharedMemoryConnector:
    # the producer adds page digests (verify_pages); a consumer with verify off ignores them
    cfg = {"namespace": ns, "share_cache": True, "verify": verify, "verify_pages": True}
    return SharedMemoryConnector(cfg)


def _region(backend: SharedMemoryConnector) -> Any:
    """The backend's cache region (``share_cache`` is on); ``Any`` for the timing hook."""
    region = backend.cache_region
    assert region is not None, "share_cache is off"
    return region


def _allocate(backend: SharedMemoryConnector, nblocks: int, seed: int) -> list[torch.Tensor]:
    """vLLM's CPU KV cache: one int8 buffer from the backend's allocation context, one
    layer-major ``[blocks, H, N, 2D]`` bf16 view per layer, filled with random data."""
    layer_bytes = nblocks * PAGE_BYTES
    ctx = _region(backend).allocation_context()
    assert ctx is not None
    with ctx:
        buf = torch.zeros(LAYERS * layer_bytes, dtype=torch.int8)
    caches = [
        buf[i * layer_bytes : (i + 1) * layer_bytes].view(DTYPE).view(nblocks, HEADS, BS, 2 * DIM)
        for i in range(LAYERS)
    ]
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(DTYPE))
    return caches


def _ids(nblocks: int, used: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(b) for b in torch.randperm(nblocks, generator=g)[:used]]


class _Buffers:
    """Two pre-faulted contiguous buffers of ``nbytes``: the memcpy baseline."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def memcpy(self) -> None:
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)

    def streamed(self) -> None:
        """The same bytes with streaming stores (the native copy's one run)."""
        n, one = self.nbytes, page_copy.pack_runs([(0, 0, 1)])
        page_copy.copy_runs((self.dst.data_ptr(), n, 1), (self.src.data_ptr(), n, 1), n, one, True)

    def pieces(self) -> None:
        """The same bytes, one ``memmove`` per page."""
        d, s, n = self.dst.data_ptr(), self.src.data_ptr(), self.nbytes
        for off in range(0, n, PAGE_BYTES):
            ctypes.memmove(d + off, s + off, min(PAGE_BYTES, n - off))


@contextlib.contextmanager
def _native_copy(on: bool) -> Any:
    """Inside it, page copies use the native extension only if ``on``."""
    saved, page_copy._native = page_copy._native, page_copy._native if on else None
    try:
        yield
    finally:
        page_copy._native = saved


@contextlib.contextmanager
def _cached_stores() -> Any:
    """Inside it, page copies of every size use cached stores (no streaming)."""
    saved, movers.STREAM_MIN_BYTES = movers.STREAM_MIN_BYTES, 1 << 62
    try:
        yield
    finally:
        movers.STREAM_MIN_BYTES = saved


def _evict() -> None:
    """Write 64 MiB of other memory: what a move finds after the engines ran in between."""
    torch.ones(64 << 20, dtype=torch.uint8)


def _interleaved(
    fns: dict[str, Any], repeats: int, before: dict[str, Any] | None = None
) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds that run every one in
    turn (so that a drift of this host's memory bandwidth hits them alike), after one
    warm-up round; ``before[name]`` runs untimed before each call of ``fns[name]``."""
    before = before or {}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):
        for k, fn in fns.items():
            if k in before:
                before[k]()
            t0 = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# -- producer: the cache in shared memory, one hold + put per round -----------------------------


def _producer(ns: str, nblocks: int, used: int, cmds: Any, out: Any) -> None:
    torch.set_num_threads(1)
    backend = _connector(ns)
    region = _region(backend)
    try:
        caches = _allocate(backend, nblocks, seed=1)
        got = region.export(caches)
        assert got is not None, "the cache is not in the shared region"
        geometry = layer_geometry(caches, got[1], got[2])
        ids = _ids(nblocks, used, seed=2)
        out.send(("ready", ids))
        while True:
            cmd = cmds.recv()
            if cmd is None:
                break
            key, digests = cmd
            t0 = time.perf_counter()
            hold = region.hold(*EDGE, key)
            data = describe_request(
                key,
                ids,
                used * BS,
                caches,
                IDENT,
                {"region": got[0], "geometry": geometry, "hold": hold},
                digests=digests,
            )
            t1 = time.perf_counter()
            backend.put(*EDGE, key, data)
            out.send({"hold + describe_request": t1 - t0, "put": time.perf_counter() - t1})
    finally:
        backend.close()
        out.close()


# -- consumer: its own cache in its own region; open -> copied ---------------------------------


class _Consumer:
    """The consumer process's state: its cache, two backends (verify on / off), the
    memcpy buffers, and the last payload (for the profile)."""

    def __init__(self, ns: str, nblocks: int, used: int) -> None:
        self.backends = {v: _connector(ns, verify=v) for v in (True, False)}
        self.caches = _allocate(self.backends[True], nblocks, seed=99)
        self.dst_ids = _ids(nblocks, used, seed=3)
        self.bufs = _Buffers(used * PAGE_BYTES * LAYERS)
        self.obj: dict[str, Any] = {}
        self.views: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.dst_pages = [page_view(c, IDENT) for c in self.caches]

    def handle(self, cmd: tuple[Any, ...], repeats: int) -> Any:
        if cmd[0] == "memcpy":
            return _interleaved({"m": self.bufs.memcpy}, repeats)["m"]
        if cmd[0] == "profile":
            return self.profile(cmd[1], repeats)
        _what, key, mode, src_ids, check = cmd
        memcpy_s = _interleaved({"m": self.bufs.memcpy}, 3)["m"]  # just before the move
        got = self.move(key, mode, src_ids, check)
        # after the move, so that its evictions leave the move's own state as it was
        cold_s = _interleaved({"m": self.bufs.memcpy}, 3, {"m": _evict})["m"]
        return None if got is None else (memcpy_s, cold_s, *got)

    def move(
        self, key: str, mode: Any, src_ids: list[int], check: bool
    ) -> tuple[float, dict[str, float]] | None:
        """One timed move (None: the entry was gone). Open the stream, copy under the
        hold, close. With ``check``,
        compare the copied pages with the producer's (an independent ``torch.equal``;
        done on warm-up moves only, as it evicts the caches)."""
        verify = mode is True
        backend = self.backends[verify]
        region, caches = _region(backend), self.caches
        if check:  # a stale copy must not pass: scrub the destination pages first
            for c in caches:
                c[self.dst_ids] = 0
        t0 = time.perf_counter()
        stream = backend.open_stream(*EDGE, key)
        t_open = time.perf_counter()
        if stream is None:
            return None
        with stream, _native_copy(mode != FALLBACK):
            obj = stream.obj
            plan = SharedPagesPlan(obj, region, caches, IDENT, self.dst_ids, 0, verify)
            tokens, moved = plan.apply(stream, time.monotonic() + 60), plan.moved
            t_copied = time.perf_counter()
        t1 = time.perf_counter()
        if tokens != len(src_ids) * BS or moved != self.bufs.nbytes:
            raise RuntimeError(f"{key}: {tokens} tokens / {moved} bytes moved")
        if os.path.exists(os.path.join(arena.SHM_DIR, obj["metadata"]["shared"]["hold"])):
            raise RuntimeError(f"{key}: the hold was not released after the copy")
        if verify:  # the profile times digest checks against this payload's sums
            self.obj = obj
        if check:
            for sp, dp in zip(_producer_layers(region, obj), caches, strict=True):
                if not torch.equal(sp[src_ids], dp[self.dst_ids]):
                    raise RuntimeError(f"{key}: copied pages differ from the producer's")
        phases = {"open_stream": t_open - t0, "SharedPagesPlan.apply": t_copied - t_open}
        phases["close"] = t1 - t_copied
        return t1 - t0, phases

    def profile(self, src_ids: list[int], repeats: int) -> dict[str, float]:
        """Median seconds of each step of a move alone, interleaved round by round."""
        region = _region(self.backends[True])
        obj = self.obj
        sums = obj["metadata"]["shared"]["sums"]
        pairs = list(zip(src_ids, self.dst_ids, strict=True))
        src = [page_view(v, IDENT) for v in _producer_layers(region, obj)]
        dst = [page_view(c, IDENT) for c in self.caches]
        n = [0]

        def hold_and_read() -> None:
            n[0] += 1
            with region.reading(region.hold(*EDGE, f"profile{n[0]}")):
                pass

        def bare() -> None:
            for sp, dp in zip(src, dst, strict=True):
                s0, d0 = sp.data_ptr(), dp.data_ptr()
                for s, d in pairs:
                    ctypes.memmove(d0 + d * PAGE_BYTES, s0 + s * PAGE_BYTES, PAGE_BYTES)

        nv = lambda: copy_pages(src, dst, pairs, None)  # noqa: E731

        def cached() -> None:
            with _cached_stores():
                nv()

        fns = {
            "memcpy": self.bufs.memcpy,
            "memcpy, caches evicted first": self.bufs.memcpy,
            PIECES: self.bufs.pieces,
            STREAM: self.bufs.streamed,
            BARE: bare,
            "copy_pages, no verify": nv,
            "copy_pages, no verify, caches evicted first": nv,
            "copy_pages, no verify, cached stores": cached,
            "copy_pages, no verify, cached stores, caches evicted first": cached,
            "copy_pages, verify": lambda: copy_pages(src, dst, pairs, sums),
            "page_sums of the copied pages (digests alone)": lambda: page_sums(dst, self.dst_ids),
            "hold create + reading()": hold_and_read,
            "attach + attach_layers (mapped)": lambda: _producer_layers(region, obj),
        }
        return _interleaved(fns, repeats, {k: _evict for k in fns if "evicted" in k})


def _consumer(ns: str, nblocks: int, used: int, repeats: int, cmds: Any, out: Any) -> None:
    torch.set_num_threads(1)
    me = _Consumer(ns, nblocks, used)
    try:
        while (cmd := cmds.recv()) is not None:
            out.send(me.handle(cmd, repeats))
    finally:
        for b in me.backends.values():
            b.close()
        out.close()


def _producer_layers(region: Any, obj: dict[str, Any]) -> list[torch.Tensor]:
    shared = obj["metadata"]["shared"]
    return attach_layers(region.attach(shared["region"]), shared["geometry"], IDENT, DTYPE)


# -- one size ----------------------------------------------------------------------------------


class _Pair:
    """A producer and a consumer process sharing a fresh namespace."""

    def __init__(self, nblocks: int, used: int, repeats: int) -> None:
        ctx = mp.get_context("spawn")
        self.ns = f"onecopy{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.p_cmd, p_cmd_r = ctx.Pipe()
        p_out_w, self.p_out = ctx.Pipe()
        self.c_cmd, c_cmd_r = ctx.Pipe()
        c_out_w, self.c_out = ctx.Pipe()
        self.procs = [
            ctx.Process(target=_producer, args=(self.ns, nblocks, used, p_cmd_r, p_out_w)),
            ctx.Process(target=_consumer, args=(self.ns, nblocks, used, repeats, c_cmd_r, c_out_w)),
        ]
        for p in self.procs:
            p.start()
        self.src_ids: list[int] = self._recv(self.p_out)[1]
        self.n = self.lost = 0

    def _recv(self, conn: Any) -> Any:
        while all(p.is_alive() for p in self.procs) or conn.poll(0):
            if conn.poll(0.5):
                return conn.recv()
        raise RuntimeError("a benchmark process did not answer (see its traceback)")

    def consumer(self, *cmd: Any) -> Any:
        self.c_cmd.send(cmd)
        return self._recv(self.c_out)

    def move(self, mode: Any, check: bool = False) -> tuple[float, float, float, dict[str, float]]:
        """``(memcpy seconds just before, the same after evicting the caches, move seconds,
        phases)`` of one move. A published entry that is gone when the consumer opens it is
        counted in ``lost`` and retried."""
        for _ in range(3):
            self.n += 1
            self.p_cmd.send((key := f"req{self.n}", mode is True))
            produced = self._recv(self.p_out)
            got = self.consumer("move", key, mode, self.src_ids, check)
            if got is not None:
                memcpy_s, cold_s, move_s, phases = got
                made = {f"producer: {k}": v for k, v in produced.items()}
                return memcpy_s, cold_s, move_s, {**phases, **made}
            self.lost += 1
        raise RuntimeError("3 published entries in a row were gone when opened")

    def close(self) -> None:
        for conn in (self.p_cmd, self.c_cmd):
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def _target(row: dict[str, Any], mib: int) -> None:
    """Issue 30's targets for the default move, against the memcpy just before it: at
    least 85% from 64 MiB, at least 50% at 4 MiB (none recorded for other sizes)."""
    target = 0.85 if mib >= 64 else 0.5 if mib == 4 else None
    if target is not None and row["path"] == ONE_COPY_NV:
        row["target"] = target
        row["meets_target"] = row["fraction_of_memcpy"] >= target


def measure_size(mib: int, repeats: int, trials: int) -> list[dict[str, Any]]:
    """memcpy, one-copy moves (verify / no verify, alternating) and the two-copy move for
    one size. Every one-copy move is compared with a memcpy (median of 3) run in the
    consumer just before it; the two-copy move, once per trial, with a memcpy (median of
    ``2 * repeats``) just before it."""
    used = max(1, (mib << 20) // BYTES_PER_TOKEN // BS)
    nbytes = used * PAGE_BYTES * LAYERS
    pair = _Pair(used + 4, used, repeats)
    modes: list[tuple[str, Any]] = [(ONE_COPY, True), (ONE_COPY_NV, False), (FALLBACK, FALLBACK)]
    samples: dict[str, list[tuple[float, float]]] = {p: [] for p, _ in modes}
    colds: dict[str, list[float]] = {p: [] for p in samples}  # memcpy with the caches evicted
    phases: dict[str, list[dict[str, float]]] = {p: [] for p in samples}
    two: list[tuple[float, float]] = []
    try:
        for _ in range(trials):
            for _path, mode in modes:
                pair.move(mode, check=True)  # warm-up, bytes checked
            for _ in range(repeats):
                for path, mode in modes:
                    m, c, s, ph = pair.move(mode)
                    samples[path].append((s, m))
                    colds[path].append(c)
                    phases[path].append(ph)
            base = pair.consumer("memcpy")
            two.append((shm_move(nbytes, repeats)[0], base))
        profile = pair.consumer("profile", pair.src_ids)
    finally:
        pair.close()
    samples[TWO_COPY] = two
    memcpy_s = statistics.median(b for _, b in samples[ONE_COPY] + two)
    rows = [_row("memcpy", nbytes, memcpy_s, memcpy_s, load_average=os.getloadavg())]
    rows[0].update(namespaces=[pair.ns, f"bench{os.getpid()}"], lost_entries=pair.lost)
    cold_s = statistics.median(c for cs in colds.values() for c in cs)
    rows.append(_row(COLD, nbytes, cold_s, memcpy_s, diagnostic=True))
    for path, got in samples.items():
        fractions = [b / m for m, b in got]
        row = _row(path, nbytes, statistics.median(m for m, _ in got), memcpy_s)
        row["fraction_of_memcpy"] = statistics.median(fractions)
        row["fraction_samples"] = [round(f, 3) for f in fractions]
        if path in colds:  # against a memcpy that finds its bytes out of cache, as a move does
            cold = [c / m for (m, _), c in zip(got, colds[path], strict=True)]
            row["fraction_of_cold_memcpy"] = statistics.median(cold)
            _target(row, mib)
        if path in phases:  # and producer start (hold, digests, put) -> copied
            phs = phases[path]
            row["phases_s"] = {k: statistics.median(p[k] for p in phs) for k in phs[0]}
            e2e = [b / (m + sum(v for k, v in p.items() if "producer" in k)) for (m, b), p in zip(got, phs, strict=True)]  # fmt: skip
            row["end_to_end_fraction_of_memcpy"] = statistics.median(e2e)
        rows.append(row)
    two_copy = next(r for r in rows if r["path"] == TWO_COPY)["fraction_of_memcpy"]
    for row in rows[2:5]:  # one-copy bytes/s over two-copy bytes/s, same memcpy scale
        row["vs_two_copy"] = row["fraction_of_memcpy"] / two_copy
    base = profile["memcpy"]
    for path in (PIECES, BARE, STREAM):
        rows.append(_row(path, nbytes, profile[path], base, diagnostic=True))
    rows.append({"path": "profile", "size_mib": rows[0]["size_mib"], "steps_s": profile})
    line = f"{mib:4d} MiB  memcpy {nbytes / memcpy_s / 1e9:6.2f} GB/s"
    for r in rows[1:-1]:
        line += f" | {r['path'].split(' (')[0]}: {r['fraction_of_memcpy']:.0%}"
        if "fraction_samples" in r:
            line += f" ({min(r['fraction_samples']):.0%}-{max(r['fraction_samples']):.0%})"
        if "fraction_of_cold_memcpy" in r:
            line += f" cold {r['fraction_of_cold_memcpy']:.0%}"
    print(line, flush=True)
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    paths = ["memcpy", ONE_COPY, ONE_COPY_NV, TWO_COPY, PIECES, BARE, FALLBACK, STREAM, COLD]
    for i, p in enumerate(paths):
        pts = sorted(((r["size_mib"], r) for r in rows if r.get("path") == p), key=lambda t: t[0])
        xs = [x for x, _ in pts]
        style: dict[str, Any] = {
            "ls": ":" if p in (PIECES, BARE, STREAM, COLD) else "-",
            "marker": "o",
            "label": p,
            "c": f"C{i}",
        }
        style["lw"] = 2.5 if p in ("memcpy", ONE_COPY_NV) else 1.5
        ax.plot(xs, [r["gbps"] for _, r in pts], **style)
        if p != "memcpy":
            bx.plot(xs, [r["fraction_of_memcpy"] for _, r in pts], **style)
    bx.axhline(0.85, color="grey", ls="--", lw=1, label="target: 85% of memcpy")
    for a, ylabel in ((ax, "GB/s"), (bx, "fraction of memcpy (same trial; dashed: 85%)")):
        a.set(xscale="log", xlabel="payload (MiB)", ylabel=ylabel)
        a.grid(True, alpha=0.3)
    bx.set_ylim(0, 1.7)
    ax.set_title("cache->cache move on one host")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 MiB, 3 repeats, 1 trial")
    ap.add_argument("--out", type=Path, default=RESULTS / "one_copy_bench.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(json.loads(a.out.read_text())["rows"], a.out.with_suffix(".png"))
        return
    sizes, repeats, trials = ([4], 3, 1) if a.quick else (a.sizes, a.repeats, a.trials)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for mib in sizes:
        rows += measure_size(mib, repeats, trials)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "one_copy_bench",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "torch": torch.__version__,
        "kv_shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "block_size": BS,
                     "dtype": str(DTYPE), "page_bytes": PAGE_BYTES},
        "repeats": repeats,
        "trials": trials,
        "rows": rows,
    }  # fmt: skip
    a.out.write_text(json.dumps(result, indent=2))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
