"""Latency of a small pull: the ``get`` of a frame of a few KiB (a ``register_cache``
payload's block ids and geometry, a short request's state), beside what it cannot go below,
measured in the same run.

    python benchmarks/small_get_bench.py            # NIXL and Mooncake TE, 1..48 KiB
    python benchmarks/small_get_bench.py --quick    # one size of each kind, for smoke tests

A spawned sender process holds the connector that ``put`` the frames (``max_pulls: 0``, so
one frame serves every get); this process holds the receiver. Per round, in turn: a
side-channel ``ping`` round trip, the engine's raw read of the frame's bytes from the
sender's pool (from the put's metadata), and a ``get`` of each frame (acquire, the frame,
verification, decode, release). A ``get`` needs two side-channel round trips (acquire and
release): ``limit_ms`` is twice the ping's median, and ``vs_limit`` that over the get's.
Frames of at most ``INLINE_MAX`` bytes come in the acquire reply (``inline``); larger
ones add an engine read. Writes ``results/small_get_bench.{json,png}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bar_plot import grouped_bars  # noqa: E402

from vllm_omni_kv.backends.pull.exposure import INLINE_MAX  # noqa: E402
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "small_get_bench.json"
EDGE = ("prefill", "decode")
KIB = (1, 4, 12, 24, 48)
ENGINES = {"nixl": "nixl", "mooncake_te": "mooncake.engine"}


def _config(engine: str, role: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "role": role,
        "host": "127.0.0.1",
        "zmq_port": 0,
        "memory_pool_size": 32 << 20,
        "transfer_timeout_s": 20.0,
        "side_channel_timeout_s": 5.0,
        "max_pulls": 0,
    }
    if engine == "mooncake_te":
        cfg.update({"protocol": "tcp", "metadata_server": "P2PHANDSHAKE"})
    return cfg


def _connector(engine: str, role: str) -> Any:
    if engine == "nixl":
        from vllm_omni_kv.backends.nixl.connector import NixlPullConnector

        return NixlPullConnector(_config(engine, role))
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    return MooncakeTransferEngineConnector(_config(engine, role))


def _payload(kib: int) -> dict[str, Any]:
    """About ``kib`` KiB of int32 ids, as a small payload's block table is."""
    return {"ids": torch.arange(kib * 256, dtype=torch.int32), "num_tokens": kib}


def _sender(engine: str, sizes: list[int], conn: Connection) -> None:
    """Put one frame per size, send the connection info and each put's metadata, then
    wait for the word to close."""
    torch.set_num_threads(1)
    s = _connector(engine, "sender")
    try:
        metas = {k: s.put(*EDGE, f"f{k}", _payload(k))[2] for k in sizes}
        conn.send((s.get_connection_info(), metas))
        conn.recv()
    finally:
        s.close()


class _Receiver:
    """The receiver connector, its side-channel client and a pool block for raw reads."""

    def __init__(self, engine: str, info: dict[str, Any]) -> None:
        self.conn = _connector(engine, "receiver")
        self.conn.update_sender_info(info["host"], info["zmq_port"])
        self.endpoint = f"tcp://{info['host']}:{info['zmq_port']}"
        self.client = SideChannelClient(5.0)
        self.block = self.conn.pool.alloc(64 << 10)

    def ping(self) -> None:
        assert self.client.request(self.endpoint, {"op": "ping"})["ok"]

    def raw(self, meta: dict[str, Any]) -> None:
        n = meta["data_size"]
        self.conn.engine.read(meta["session"], self.block.address, meta["src_addr"], n)

    def get(self, kib: int) -> None:
        got = self.conn.get(*EDGE, f"f{kib}")
        assert got is not None and torch.equal(got[0]["ids"], _payload(kib)["ids"])

    def close(self) -> None:
        self.block.release()
        self.client.close()
        self.conn.close()


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def measure(engine: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Rows of one engine: rounds of ping, raw reads and gets, each timed in turn."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(engine, sizes, theirs), daemon=True)
    proc.start()
    try:
        if not mine.poll(120):
            raise RuntimeError(f"the {engine} sender did not start (see its traceback)")
        info, metas = mine.recv()
        rx = _Receiver(engine, info)
        try:
            times: dict[str, list[float]] = {}
            for i in range(repeats + 3):  # three warm-up rounds
                steps: list[tuple[str, Callable[[], None]]] = [("ping", rx.ping)]
                for k in sizes:
                    steps += [
                        (f"raw{k}", partial(rx.raw, metas[k])),
                        (f"get{k}", partial(rx.get, k)),
                    ]
                for name, fn in steps:
                    t0 = time.perf_counter()
                    fn()
                    if i >= 3:
                        times.setdefault(name, []).append(time.perf_counter() - t0)
        finally:
            rx.close()
        mine.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    ping = _median_ms(times["ping"])
    rows = []
    for k in sizes:
        get = _median_ms(times[f"get{k}"])
        size = int(metas[k]["data_size"])
        rows.append(
            {
                "engine": engine,
                "kib": k,
                "frame_bytes": size,
                "inline": size <= INLINE_MAX,
                "get_ms": get,
                "ping_ms": ping,
                "limit_ms": round(2 * ping, 4),
                "vs_limit": round(2 * ping / get, 3),
                "raw_read_ms": _median_ms(times[f"raw{k}"]),
            }
        )
    return rows


def plot(result: dict[str, Any], path: Path) -> bool:
    """Get vs two side-channel round trips vs one raw engine read; False without matplotlib."""
    rows = result["rows"]
    labels = [f"{r['engine']}\n{r['kib']} KiB{'*' if r['inline'] else ''}" for r in rows]
    series = [
        (name, [r[key] for r in rows])
        for key, name in (
            ("get_ms", "get"),
            ("limit_ms", "2 side-channel round trips"),
            ("raw_read_ms", "raw read"),
        )
    ]
    title = f"Small pulls on one host (* frame in the acquire reply, <= {INLINE_MAX} B)"
    width = max(6.0, len(rows) * 0.9)
    return grouped_bars(path, labels, series, "ms (median)", title, width=width, label_size=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 and 24 KiB, 20 rounds")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sizes, repeats = ([4, 24], 20) if args.quick else (list(KIB), args.repeats)
    result: dict[str, Any] = {
        "benchmark": "small_get_bench",
        "machine": {"cpu": platform.machine(), "cores": mp.cpu_count()},
        "torch": torch.__version__,
        "inline_max": INLINE_MAX,
        "repeats": repeats,
        "rows": [],
        "skipped": {},
    }
    for engine in args.engines:
        if importlib.util.find_spec(ENGINES[engine]) is None:
            result["skipped"][engine] = f"{ENGINES[engine]} is not installed"
            continue
        result["rows"] += measure(engine, sizes, repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for r in result["rows"]:
        print(json.dumps(r))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
