"""Staging device<->host copies of a request's KV pages, against a plain pinned copy.

For each request size the benchmark builds a FlashAttention cache as vLLM 0.32 does
(LBNHC, bf16, 32 layers, 8 KV heads, head size 128, 32-token blocks; fewer KV heads
below 4 MiB, so that 1 MiB is one page per layer; the layout emulator), then measures in
the same run:

* ``pinned D2H`` / ``pinned H2D``: one copy of the same bytes between a contiguous
  device tensor and pinned host memory (the physical limit, ~54-55 GB/s each way on
  PCIe Gen5 x16);
* ``staged D2H``: the producer's path: block ids uploaded once, every layer's pages
  gathered into one device staging buffer laid out as the frame's data, on a side
  stream, then one copy into host memory registered with CUDA (``cudaHostRegister``,
  as the shared-memory arena does) and one host wait;
* ``direct D2H``: the same pages read per layer without the stager (an
  ``index_select`` temporary and a synchronous copy per layer);
* ``frame pack``: the staged path writing a whole frame (with its xxh3 digests);
* ``inject H2D``: the consumer's path: block ids uploaded once, the pages of every
  layer from registered host memory in one copy, one ``index_copy_`` per layer into
  the request's blocks of a device cache on a side stream, one host wait.

Each measured path's row carries its target (issue 30) and ``meets_target``, judged
against the limit measured in the same run: staged D2H and inject H2D at least 85% of the
pinned copy from 16 MiB on and 60% below; frame pack (with digests) at least 70% of the
pinned D2H; a move's fixed cost (its time over the pinned copy of the same bytes, at the
smallest size of the run) at most 0.2 ms.

``--device cpu`` runs the same code on the host (a memcpy baseline); CI uses it as a
smoke test. The GPU numbers come only from a run on a GPU: the JSON names the device.
Runs without vLLM (the GPU machine has torch only); the PNG needs matplotlib
(``--plot-only`` redraws it from the JSON elsewhere).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_omni_kv.backends import host_pin  # noqa: E402
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, infer_identity, page_view  # noqa: E402
from vllm_omni_kv.kvcache.device_order import streams_of  # noqa: E402
from vllm_omni_kv.kvcache.device_staging import DeviceStager  # noqa: E402
from vllm_omni_kv.kvcache.paged_blocks import (  # noqa: E402
    extract_request_blocks,
    inject_request_blocks,
)
from vllm_omni_kv.testing.layout_emulator import EmulatedEngine, build_caches  # noqa: E402
from vllm_omni_kv.wire import codec  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 32
PAGE = HEADS * BLOCK * 2 * HEAD * 2  # bytes of one block of one layer (bf16 K|V)
SIZES_MIB = [1, 4, 16, 64, 256]
STAGED, DIRECT, PACK, INJECT = (
    "staged D2H (registered host)",
    "direct D2H (per layer)",
    "frame pack (staged + xxh3)",
    "inject H2D (registered host)",
)
#: issue 30's targets: fraction of the pinned copy (at >= 16 MiB, below), fixed cost
LARGE_MIB, LARGE_RATIO, SMALL_RATIO, PACK_RATIO, FIXED_MS = 16, 0.85, 0.60, 0.70, 0.2


def target_of(path: str, mib: float) -> dict[str, float] | None:
    """The target of a row (None: a limit or a reference path)."""
    if path in (STAGED, INJECT):
        return {"min_ratio": LARGE_RATIO if mib >= LARGE_MIB else SMALL_RATIO}
    if path == PACK:
        return {"min_ratio": PACK_RATIO}
    if path.startswith("fixed cost"):
        return {"max_ms": FIXED_MS}
    return None


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its ``target`` and ``meets_target`` (None where it has no target)."""
    target = target_of(row["path"], row["mib"])
    met: bool | None = None
    if target is not None and "min_ratio" in target:
        met = row["ratio_to_pinned"] is not None and row["ratio_to_pinned"] >= target["min_ratio"]
    elif target is not None:
        met = row["ms"] <= target["max_ms"]
    return {**row, "target": target, "meets_target": met}


def fixed_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per moving path, its time over the pinned copy of the same bytes at the smallest
    size of the run (what a move costs besides its bytes)."""
    if not rows:
        return []
    mib = min(r["mib"] for r in rows)
    out = []
    for path in (STAGED, INJECT):
        r = next((r for r in rows if r["path"] == path and r["mib"] == mib), None)
        if r is not None and r.get("overhead_ms") is not None:
            ms = max(0.0, r["overhead_ms"])
            out.append(judge({"path": f"fixed cost: {path}", "mib": mib, "ms": round(ms, 4)}))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (one warm-up run first)."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class HostBuffer:
    """A /dev/shm mapping registered with CUDA, like an arena segment."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"/dev/shm/omnikv_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        fd = os.open(self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            os.unlink(self.name)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pin = host_pin.register(self.tensor.data_ptr(), nbytes)

    def close(self) -> None:
        if self.pin is not None:
            self.pin.release()
        del self.tensor
        self.mm.close()


def geometry(mib: float) -> tuple[int, int]:
    """``(KV heads, blocks)`` of a request of about ``mib`` MiB: 8 heads (128 KiB pages)
    from 4 MiB on, fewer heads below (a 1 MiB move is one 32 KiB page per layer)."""
    want = int(mib * (1 << 20))
    if want >= LAYERS * PAGE:
        return HEADS, want // (LAYERS * PAGE)
    return max(1, want // (LAYERS * BLOCK * 2 * HEAD * 2)), 1


def _engine(blocks: int, device: torch.device, heads: int = HEADS) -> EmulatedEngine:
    return EmulatedEngine(
        backend="FLASH_ATTN",
        layout="LBNHC",
        dtype="bfloat16",
        num_layers=LAYERS,
        num_blocks=blocks,
        block_size=BLOCK,
        kv_heads=heads,
        head_size=HEAD,
        device=str(device),
    )


def measure(mib: int, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    heads, n = geometry(mib)  # n: blocks of the request
    page = heads * BLOCK * 2 * HEAD * 2
    nbytes = n * LAYERS * page
    e = _engine(2 * n + 2, device, heads)
    caches = list(build_caches(e).values())
    for c in caches:
        c.view(torch.int16).random_(-1000, 1000)
    ident: KVLayoutId = infer_identity(caches[0], packing="k_v")
    ids = list(range(1, 2 * n + 1, 2))  # every other block: scattered like a real request
    tokens = n * BLOCK
    stager = DeviceStager(device, max_bytes=max(nbytes * 2, 1 << 21))
    host = HostBuffer(nbytes + (1 << 20))
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    rows: list[dict[str, Any]] = []

    def row(path: str, seconds: float, base: float | None) -> None:
        gbps = nbytes / seconds / 1e9
        r = {
            "path": path,
            "mib": nbytes / (1 << 20),
            "gbps": round(gbps, 3),
            "ratio_to_pinned": None if base is None else round(base / seconds, 3),
            "overhead_ms": None if base is None else round((seconds - base) * 1e3, 4),
            "pinned_host": host.pin is not None,
            "pages": n,
            "kv_heads": heads,
        }
        rows.append(judge(r))

    def layer_dsts() -> list[torch.Tensor]:
        out, off = [], 0
        for c in caches:
            k = n * page
            out.append(host.tensor[off : off + k].view(c.dtype).view(n, *ident.page_shape))
            off += k
        return out

    dsts = layer_dsts()
    views = [page_view(c, ident) for c in caches]

    def staged() -> None:
        s = stager.gather(views, ids)
        assert s is not None
        for i, d in enumerate(dsts):  # as a frame does: every layer placed, then filled
            s.place(i)(d)
        for i, d in enumerate(dsts):
            for _ in s.fill(i)(d):
                pass

    def direct() -> None:
        data = extract_request_blocks("b", ids, tokens, caches, layout=ident)
        for lazy, d in zip(data.layer_blocks["kv_blocks"], dsts, strict=True):
            for _ in lazy.fill(d) or ():
                pass

    def frame_pack() -> None:
        data = extract_request_blocks("b", ids, tokens, caches, layout=ident, stager=stager)
        codec.encode(data, chunk_bytes=page).pack_into(host.mm)

    d2h_base = _timed(lambda: pinned.copy_(flat, non_blocking=True), device, repeats)
    row("pinned D2H" if device.type == "cuda" else "memcpy", d2h_base, d2h_base)
    row(STAGED, _timed(staged, device, repeats), d2h_base)
    row(DIRECT, _timed(direct, device, repeats), d2h_base)
    row(PACK, _timed(frame_pack, device, repeats), d2h_base)

    payload = {
        "request_id": "b",
        "block_ids": ids,
        "layer_blocks": {"kv_blocks": dsts},
        "metadata": extract_request_blocks("b", ids, tokens, caches, layout=ident).metadata,
    }
    back = list(range(0, 2 * n, 2))

    streams = streams_of(device)

    def inject() -> None:  # on a side stream, as a load thread writes (one host wait)
        if streams is None:
            inject_request_blocks(payload, caches, back, layout=ident)
            return
        with streams.use(streams.side(device)):
            inject_request_blocks(payload, caches, back, layout=ident)

    h2d_base = _timed(lambda: flat.copy_(pinned, non_blocking=True), device, repeats)
    row("pinned H2D" if device.type == "cuda" else "memcpy (back)", h2d_base, h2d_base)
    row(INJECT, _timed(inject, device, repeats), h2d_base)
    stager.close()
    host.close()
    return rows


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "gbps" in r]
    sizes = sorted({r["mib"] for r in rows})
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(paths)
    for j, p in enumerate(paths):
        ys = [next((r["gbps"] for r in rows if r["path"] == p and r["mib"] == s), 0) for s in sizes]
        ax.bar([i + j * width for i in range(len(sizes))], ys, width, label=p)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
    ax.set_xticklabels([f"{s:.0f} MiB" for s in sizes])
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV page staging on {result['device_name']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=int, nargs="+", default=SIZES_MIB)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="4 MiB, 3 repeats")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu_copy_bench.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    a = ap.parse_args(argv)
    if a.plot_only:
        _plot(json.loads(a.out.read_text()), a.out.with_suffix(".png"))
        return
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_copy_bench: no CUDA device here; run it on a GPU (or --device cpu)")
    if a.quick:
        a.mib, a.repeats = [4], 3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    rows: list[dict[str, Any]] = []
    for mib in a.mib:
        rows += measure(mib, device, a.repeats)
    rows += fixed_costs(rows)
    result = {"device": str(device), "device_name": name or "cpu", "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    for r in rows:
        what = f"{r['ms']:8.3f} ms" if "ms" in r else f"{r['gbps']:8.2f} GB/s"
        met = {None: "", True: "  meets target", False: "  MISSES target"}[r["meets_target"]]
        ratio = f"  x{r['ratio_to_pinned']}" if "ratio_to_pinned" in r else ""
        print(f"{r['mib']:7.1f} MiB  {r['path']:44s} {what}{ratio}{met}")
    try:
        _plot(result, a.out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: JSON written, redraw the PNG with --plot-only elsewhere")


if __name__ == "__main__":
    main()
