"""Latency of a small pull: the ``get`` of a few KiB (a ``register_cache`` payload's frame of
block ids and geometry, a short request's state, a small tensor), beside what it cannot go
below, measured in the same run.

    python benchmarks/small_get_bench.py            # NIXL and Mooncake TE, 1 KiB..1 MiB
    python benchmarks/small_get_bench.py --quick    # frames of 4 and 24 KiB, for smoke tests

A spawned sender process holds the connector that ``put`` the payloads (``max_pulls: 0``, so
one put serves every get): packed frames of int32 ids of 1 KiB..1 MiB and bare tensors of 4 and
24 KiB (the fast path). This process holds the receiver. Per round, in turn: a side-channel
``ping`` round trip, then per payload the engine's raw read of its bytes from the sender's
pool (from the put's metadata) and a ``get`` (acquire, the bytes, checks, decode, release).
A ``get`` needs two side-channel round trips (acquire and release): ``limit_ms`` is twice the
ping's median, and ``vs_limit`` that over the get's. Gets and raw reads also carry their
90th percentile (``get_p90_ms``, ``raw_read_p90_ms``): a transport's occasional stalls.
Payloads of at most ``INLINE_MAX`` bytes come in the acquire reply (``inline``); larger ones
add an engine read. Writes ``results/small_get_bench.{json,png}``.
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
#: (kind, KiB): packed frames of int32 ids (a payload's block table; from 256 KiB a frame's
#: head and tail are two ranges read at once), and bare tensors put on the fast path
ITEMS = [("frame", k) for k in (1, 4, 12, 24, 48, 256, 1024)] + [("tensor", k) for k in (4, 24)]
Item = tuple[str, int]
#: the receiver's block for raw reads: the largest payload's frame fits
RAW_BLOCK = 2 << 20
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


def _ids(kib: int) -> torch.Tensor:
    return torch.arange(kib * 256, dtype=torch.int32)


def _payload(item: Item) -> Any:
    """About ``kib`` KiB of int32 ids: in a frame, as a small payload's block table, or bare."""
    kind, kib = item
    return {"ids": _ids(kib), "num_tokens": kib} if kind == "frame" else _ids(kib)


def _name(item: Item) -> str:
    return f"{item[0]}{item[1]}"


def _sender(engine: str, items: list[Item], conn: Connection) -> None:
    """Put one payload per item, send the connection info and each put's metadata, then
    wait for the word to close."""
    torch.set_num_threads(1)
    s = _connector(engine, "sender")
    try:
        metas = {_name(it): s.put(*EDGE, _name(it), _payload(it))[2] for it in items}
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
        self.block = self.conn.pool.alloc(RAW_BLOCK)

    def ping(self) -> None:
        assert self.client.request(self.endpoint, {"op": "ping"})["ok"]

    def raw(self, meta: dict[str, Any]) -> None:
        n = meta["data_size"]
        assert n <= RAW_BLOCK, f"a {n}-byte payload does not fit the raw-read block"
        self.conn.engine.read(meta["session"], self.block.address, meta["src_addr"], n)

    def get(self, item: Item) -> None:
        got = self.conn.get(*EDGE, _name(item))
        assert got is not None
        ids = _ids(item[1])
        if item[0] == "frame":
            assert torch.equal(got[0]["ids"], ids)
        else:  # the receive block (a ManagedBuffer), released by its reader
            assert torch.equal(got[0].tensor[: ids.numel() * 4].view(torch.int32), ids)
            got[0].release()

    def close(self) -> None:
        self.block.release()
        self.client.close()
        self.conn.close()


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _p90_ms(samples: list[float]) -> float:
    """The 90th percentile: a transport's occasional stalls show here before the median."""
    return round(statistics.quantiles(samples, n=10)[8] * 1e3, 4)


def measure(engine: str, items: list[Item], repeats: int) -> list[dict[str, Any]]:
    """Rows of one engine: rounds of ping, raw reads and gets, each timed in turn."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(engine, items, theirs), daemon=True)
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
                for it in items:
                    steps += [
                        (f"raw {_name(it)}", partial(rx.raw, metas[_name(it)])),
                        (f"get {_name(it)}", partial(rx.get, it)),
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
    for kind, kib in items:
        name = _name((kind, kib))
        get = _median_ms(times[f"get {name}"])
        size = int(metas[name]["data_size"])
        rows.append(
            {
                "engine": engine,
                "kind": kind,
                "kib": kib,
                "bytes": size,
                "inline": size <= INLINE_MAX,
                "get_ms": get,
                "get_p90_ms": _p90_ms(times[f"get {name}"]),
                "ping_ms": ping,
                "limit_ms": round(2 * ping, 4),
                "vs_limit": round(2 * ping / get, 3),
                "raw_read_ms": _median_ms(times[f"raw {name}"]),
                "raw_read_p90_ms": _p90_ms(times[f"raw {name}"]),
            }
        )
    return rows


def plot(result: dict[str, Any], path: Path) -> bool:
    """Get vs two side-channel round trips vs one raw engine read; False without matplotlib."""
    rows = result["rows"]
    labels = [
        f"{r['engine']}\n{r['kind']} {r['kib']} KiB{'*' if r['inline'] else ''}" for r in rows
    ]
    series = [
        (name, [r[key] for r in rows])
        for key, name in (
            ("get_ms", "get"),
            ("limit_ms", "2 side-channel round trips"),
            ("raw_read_ms", "raw read"),
        )
    ]
    title = f"Small pulls on one host (* in the acquire reply, <= {INLINE_MAX} B)"
    width = max(6.0, len(rows) * 0.9)
    return grouped_bars(path, labels, series, "ms (median)", title, width=width, label_size=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="frames of 4 and 24 KiB, 20 rounds")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    quick = [("frame", 4), ("frame", 24)]
    items, repeats = (quick, 20) if args.quick else (ITEMS, args.repeats)
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
        result["rows"] += measure(engine, items, repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for r in result["rows"]:
        print(json.dumps(r))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
