"""Mooncake backends beside the raw Mooncake engine, measured in the same run.

    python benchmarks/bench_backends.py --sizes 1 16 64 --repeats 5

A spawned *sender process* holds our ``MooncakeTransferEngineConnector`` (role
sender); the benchmark process holds the receiver connector. The raw baseline
drives the very same two Mooncake engines and registered pools directly, so
the difference is our overhead alone. Paths run round-robin (load from other
processes hits all alike); rows are medians of ``repeats`` after a warm-up:

* ``mooncake_raw_read`` / ``mooncake_raw_write``: one ``transfer_sync_read`` /
  ``transfer_sync_write`` of the bytes between the two processes' engines;
* ``mooncake_te_get``: our ``get`` (side-channel acquire, engine pull into the
  receiver pool, release) of a tensor the sender already ``put``;
* ``mooncake_te_put_get``: sender ``put`` of a tensor (one copy into the pool)
  plus receiver ``get``;
* ``mooncake_te_put_get_zero_copy``: ``put`` of a ``ManagedBuffer`` of the
  sender's own pool (no copy) plus ``get``;
* ``mooncake_te_object``: ``put`` + ``get`` of ``{"kv": tensor}`` through the
  packed frame (pack into the pool, xxh3 checksums on both sides, decode);
* ``mooncake_store``: ``put`` + ``get`` through ``MooncakeStoreConnector`` with
  a loopback ``mooncake_master`` (both clients in this process).

``fraction_of_raw`` compares with ``mooncake_raw_read`` of the same size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, cast

import msgpack
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

_CFG: dict[str, Any] = {
    "host": "127.0.0.1",
    "protocol": "tcp",
    "metadata_server": "P2PHANDSHAKE",
    "zmq_port": 0,
    "transfer_timeout_s": 60.0,
}


def _send(conn: Connection, msg: dict[str, Any]) -> None:
    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def _recv(conn: Connection, timeout: float = 120.0) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError("the benchmark sender process did not answer")
    msg: dict[str, Any] = msgpack.unpackb(conn.recv_bytes(), raw=False)
    if "error" in msg:
        raise RuntimeError(f"sender process: {msg['error']}")
    return msg


def _sender(conn: Connection, max_bytes: int) -> None:
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    src = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8)
    pool = 3 * max_bytes + (64 << 20)
    c = MooncakeTransferEngineConnector({**_CFG, "role": "sender", "memory_pool_size": pool})
    raw_block = c.pool.alloc(max_bytes)  # the raw baseline reads these bytes with the same engine
    raw_block.tensor.copy_(src)
    _send(
        conn,
        {
            "raw_session": c.engine.session,
            "raw_addr": raw_block.address,
            "host": c.host,
            "zmq_port": c.zmq_port,
        },
    )
    while True:
        try:
            msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
        except (EOFError, OSError):
            break
        if msg["op"] == "exit":
            break
        n, key = msg["nbytes"], msg["key"]
        t0 = time.perf_counter()
        try:
            if msg["op"] == "put":
                c.put("0", "1", key, src[:n])
            elif msg["op"] == "put_zero_copy":
                buf = c.pool.alloc(n)
                buf.tensor.copy_(src[:n])  # the producer writes its data here (not timed)
                t0 = time.perf_counter()
                c.put("0", "1", key, buf)
            elif msg["op"] == "put_object":
                c.put("0", "1", key, {"kv": src[:n]})
            _send(conn, {"put_s": time.perf_counter() - t0})
        except Exception as e:
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
    raw_block.release()
    c.close()


def _timed(fn: Callable[[], float], repeats: int) -> list[float]:
    fn()  # warm-up (connections, page faults)
    return [fn() for _ in range(repeats)]


def _row(backend: str, nbytes: int, times: list[float], raw: list[float] | None) -> dict[str, Any]:
    """Median and best (min) of the timed repeats; on a shared host the best is the
    steadier estimate of what the path costs, the median shows what load did to it."""
    med, best = statistics.median(times), min(times)
    row: dict[str, Any] = {
        "backend": backend,
        "path": backend,
        "size_mib": round(nbytes / 2**20, 3),
        "bytes": nbytes,
        "seconds": med,
        "gbps": nbytes / med / 1e9,
        "best_seconds": best,
        "best_gbps": nbytes / best / 1e9,
        "repeats": len(times),
        "loadavg_1m": os.getloadavg()[0],
    }
    if raw is not None:
        row["fraction_of_raw"] = statistics.median(raw) / med
        row["best_fraction_of_raw"] = min(raw) / best
    return row


def _te_rows(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    max_bytes = max(sizes_mib) << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, max_bytes), daemon=True)
    proc.start()
    child.close()
    rows: list[dict[str, Any]] = []
    recv_conn = None
    try:
        info = _recv(parent)
        recv_conn = MooncakeTransferEngineConnector(
            {**_CFG, "role": "receiver", "memory_pool_size": 2 * max_bytes + (64 << 20)}
        )
        recv_conn.update_sender_info(info["host"], info["zmq_port"])
        # raw baseline: the same two engines and registered pools, no connector logic
        raw = cast(Any, recv_conn.engine).engine
        dst = recv_conn.pool.alloc(max_bytes)
        counter = iter(range(1 << 30))

        def raw_read(n: int) -> float:
            t0 = time.perf_counter()
            ret = raw.transfer_sync_read(info["raw_session"], dst.address, info["raw_addr"], n)
            assert ret == 0, f"raw transfer_sync_read failed ({ret})"
            return time.perf_counter() - t0

        def raw_write(n: int) -> float:
            t0 = time.perf_counter()
            ret = raw.transfer_sync_write(info["raw_session"], dst.address, info["raw_addr"], n)
            assert ret == 0, f"raw transfer_sync_write failed ({ret})"
            return time.perf_counter() - t0

        def ours(n: int, op: str, include_put: bool) -> float:
            key = f"b{next(counter)}"
            _send(parent, {"op": op, "key": key, "nbytes": n})
            put_s = float(_recv(parent)["put_s"])
            t0 = time.perf_counter()
            got = recv_conn.get("0", "1", key)
            get_s = time.perf_counter() - t0
            assert got is not None and got[1] >= n, f"get of {key} failed"
            if op == "put_object":
                assert got[0]["kv"].numel() == n
            else:
                got[0].release()
            del got
            return get_s + (put_s if include_put else 0.0)

        kinds: dict[str, Callable[[int], float]] = {
            "mooncake_raw_read": raw_read,
            "mooncake_raw_write": raw_write,
            "mooncake_te_get": lambda n: ours(n, "put", False),
            "mooncake_te_put_get": lambda n: ours(n, "put", True),
            "mooncake_te_put_get_zero_copy": lambda n: ours(n, "put_zero_copy", True),
            "mooncake_te_object": lambda n: ours(n, "put_object", True),
        }
        for mib in sizes_mib:
            n = mib << 20
            for fn in kinds.values():  # warm-up: connections, page faults
                fn(n)
            # round-robin so that load from other processes hits every path alike
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(repeats):
                for k, fn in kinds.items():
                    times[k].append(fn(n))
            raw_t = times["mooncake_raw_read"]
            for k, ts in times.items():
                rows.append(_row(k, n, ts, None if k == "mooncake_raw_read" else raw_t))
            rows[-len(times)]["_raw_times"] = raw_t  # for the store rows; removed before return
    finally:
        try:
            _send(parent, {"op": "exit"})
        except (OSError, BrokenPipeError):
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if recv_conn is not None:
            recv_conn.close()
    return rows


def _store_rows(
    sizes_mib: list[int], repeats: int, raw_by_size: dict[int, list[float]]
) -> list[dict[str, Any]]:
    from vllm_omni_kv.backends.mooncake_store.connector import MooncakeStoreConnector
    from vllm_omni_kv.backends.mooncake_store.master import mooncake_master

    max_bytes = max(sizes_mib) << 20
    rows: list[dict[str, Any]] = []
    with mooncake_master() as m:
        cfg = m.store_config(segment=2 * max_bytes + (64 << 20), localbuf=max_bytes + (16 << 20))
        a, b = MooncakeStoreConnector(cfg), MooncakeStoreConnector(cfg)
        try:
            src = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8)
            counter = iter(range(1 << 30))
            for mib in sizes_mib:

                def once(n: int = mib << 20) -> float:
                    key = f"s{next(counter)}"
                    t0 = time.perf_counter()
                    ok, _size, _meta = a.put("0", "1", key, src[:n])
                    got = b.get("0", "1", key)
                    dt = time.perf_counter() - t0
                    assert ok and got is not None and got[0].numel() == n
                    del got
                    return dt

                n = mib << 20
                rows.append(_row("mooncake_store", n, _timed(once, repeats), raw_by_size.get(n)))
        finally:
            a.close()
            b.close()
    return rows


def run_mooncake(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    """Rows ``{"backend", "path", "size_mib", "bytes", "seconds", "gbps", "fraction_of_raw"}``."""
    rows = _te_rows(sizes_mib, repeats)
    raw_by_size = {r["bytes"]: r.pop("_raw_times") for r in rows if "_raw_times" in r}
    rows += _store_rows(sizes_mib, repeats, raw_by_size)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run_mooncake(args.sizes, args.repeats)
    for r in rows:
        frac = ""
        if "fraction_of_raw" in r:
            frac = f"{r['fraction_of_raw']:5.0%} / {r['best_fraction_of_raw']:5.0%} of raw read"
        print(
            f"{r['size_mib']:6.0f} MiB  {r['backend']:30s} median {r['gbps']:5.2f} GB/s"
            f"  best {r['best_gbps']:5.2f} GB/s  {frac}"
        )
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
