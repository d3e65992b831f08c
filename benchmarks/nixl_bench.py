"""The nixl backend's put + pull against NIXL's own transfer of the same bytes, same run.

    python benchmarks/nixl_bench.py           # 16, 64, 256 MiB -> results/nixl_bench.{json,png}
    python benchmarks/nixl_bench.py --quick   # 1 and 4 MiB, for smoke tests
    python benchmarks/nixl_bench.py --device cuda --sizes 16 64 --name nixl_bench_cuda  # GPU
    python benchmarks/nixl_bench.py --direction write --name nixl_bench_write  # sender WRITEs

``--device cuda``: both pools are device memory (``memory_pool_device: cuda``, registered
as ``VRAM``), the payload is a CUDA tensor, the bare agent reads into device memory and the
copy is a device-to-device ``copy_``; ``make gpu-check`` runs it with ``UCX_TLS`` unset and
set (the JSON records ``UCX_TLS``). Without matplotlib no plot is drawn.

A sender process runs a ``NixlPullConnector`` (role sender); this process runs a receiver
connector and, beside it, a bare NIXL agent; the sender process has a bare agent too,
with the sender's pool registered. Each repeat: the sender ``put``\\ s a frame (a dict
holding one uint8 tensor: packed into its registered pool with xxh3 digests, timed in
the sender); this bare agent reads the frame's bytes straight out of the sender's pool
with one NIXL ``READ`` (``raw``), and the sender's bare agent WRITEs the same bytes
from its pool into this agent's buffer with one NIXL ``WRITE`` (``raw_write``, timed
in the sender until NIXL reports it done): NIXL's own transfers, nothing of ours. The
faster of the two is NIXL's best (``raw_best_ms``), which the target (``pull_vs_best``)
is against: with device pools UCX may serve a READ of VRAM over TCP and a WRITE over
``cuda_ipc``. Then the receiver ``get``\\ s it (lease over the side channel, the pull in
the configured direction, checksum verification, release). A ``memcpy`` of the same
bytes (torch ``copy_``) gives the machine's copy speed. Rows report medians after one
warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bar_plot import grouped_bars  # noqa: E402

from vllm_omni_kv.backends.nixl.connector import NixlPullConnector  # noqa: E402
from vllm_omni_kv.backends.nixl.handshake import MD_OP  # noqa: E402
from vllm_omni_kv.backends.nixl.loader import import_nixl, make_agent  # noqa: E402
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20


def _config(role: str, pool: int, device: str, direction: str = "auto") -> dict[str, Any]:
    return {
        "nixl_direction": direction,
        "role": role,
        "host": "127.0.0.1",
        "zmq_port": 0,
        "memory_pool_size": pool,
        "memory_pool_device": device,
        "transfer_timeout_s": 60.0,
        "max_pulls": 1,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sender_main(conn: Connection, pool: int, device: str = "cpu") -> None:
    """Child: a sender connector; ``("put", key, nbytes)`` -> ``(meta, put_seconds)``;
    ``("raw_write", peer_md, dst, src, n)`` -> seconds of one bare-agent WRITE."""
    c = NixlPullConnector(_config("sender", pool, device))
    # a bare agent with the sender's own pool registered: NIXL's WRITE of the same bytes
    raw = RawAgent("bench-raw-writer", c.base_ptr, c.pool.size, device)
    conn.send({"host": c.host, "port": c.zmq_port})
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        if msg[0] == "raw_write":  # its failure is a reply: the pull rows still count
            try:
                conn.send(raw.transfer("WRITE", *msg[1:]))
            except Exception as e:
                conn.send(f"{type(e).__name__}: {e}")
            continue
        _op, key, nbytes = msg
        data = {"kv": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)}
        _sync(device)
        t0 = time.perf_counter()
        ok, size, meta = c.put("0", "1", key, data)
        conn.send((meta, time.perf_counter() - t0, size, ok))
    raw.close()
    c.close()


class RawAgent:
    """A bare NIXL agent with one registered range: the engine's own transfers, nothing
    of ours. Its peer is another bare agent (named by its metadata) or a sender
    connector's agent."""

    def __init__(self, name: str, addr: int, size: int, device: str = "cpu") -> None:
        agent_cls, config_cls, _thread_sync = import_nixl()
        # the connectors' progress-thread setting: NIXL's own spins a core per agent
        self.agent = make_agent(agent_cls, name, config_cls(backends=["UCX"]))
        # both pools live on the same kind of memory (``--device``), the current device
        self.mem, self.dev = (
            ("VRAM", torch.cuda.current_device()) if device == "cuda" else ("DRAM", 0)
        )
        self.reg = self.agent.register_memory([(addr, size, self.dev, "")], self.mem)
        self.peers: dict[bytes, str] = {}

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def transfer(self, op: str, peer_md: bytes, remote: int, local: int, n: int) -> float:
        """Seconds of one ``op`` (READ or WRITE) of ``n`` bytes between ``local`` (ours)
        and ``remote`` (the peer's); RuntimeError when it fails or outlasts the limit."""
        if peer_md not in self.peers:
            self.peers[peer_md] = self.agent.add_remote_agent(peer_md)
        peer = self.peers[peer_md]
        t0 = time.perf_counter()
        mine = self.agent.get_xfer_descs([(local, n, self.dev)], self.mem)
        theirs = self.agent.get_xfer_descs([(remote, n, self.dev)], self.mem)
        h = self.agent.initialize_xfer(op, mine, theirs, peer)
        state = self.agent.transfer(h)
        while state == "PROC" and time.perf_counter() - t0 < RAW_TIMEOUT_S:
            state = self.agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        h.release()  # aborts one still running
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op} failed: {state} after {dt:.1f}s")
        return dt

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


class RawReader:
    """The bench's bare agent: it READs a sender's pool, and a sender's bare agent
    WRITEs into its buffer (the same bytes, the other direction)."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.raw = RawAgent("bench-raw", self.buf.data_ptr(), nbytes, device)
        self.md = self.raw.metadata()
        self.sender_md: dict[str, bytes] = {}

    def read(self, endpoint: str, agent_name: str, src: int, n: int) -> float:
        if agent_name not in self.sender_md:
            client = SideChannelClient(5.0)
            try:
                md = client.request(endpoint, {"op": MD_OP})
            finally:
                client.close()
            self.sender_md[agent_name] = bytes(md["metadata"])
        return self.raw.transfer("READ", self.sender_md[agent_name], src, self.buf.data_ptr(), n)

    def close(self) -> None:
        self.raw.close()


def _memcpy_s(nbytes: int, device: str = "cpu") -> float:
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    b.copy_(a)
    _sync(device)
    return time.perf_counter() - t0


#: issue 32: a pool move of 16 MiB and more at >= 80% of NIXL's own transfer of the bytes
TARGET = (16, 0.80)
#: the longest a raw read or a reply of the sender process may take (seconds)
RAW_TIMEOUT_S = 30.0


def _recv(conn: Any, proc: Any) -> Any:
    """The sender process's next reply; RuntimeError when it dies or takes too long."""
    deadline = time.monotonic() + RAW_TIMEOUT_S
    while not conn.poll(0.5):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the sender process died or stopped answering (see its log)")
    return conn.recv()


#: the timed steps of each repeat
SAMPLES = ("put", "pull", "raw", "raw_write", "memcpy")


def _row(nbytes: int, frame: int, med: dict[str, float], repeats: int) -> dict[str, Any]:
    """One size's row from the medians (seconds); the target is against NIXL's best."""
    best = min(med["raw"], med.get("raw_write", med["raw"]))
    gbps = {k: frame / v / 1e9 for k, v in med.items()}
    write_ms = med["raw_write"] * 1e3 if "raw_write" in med else None
    aimed = nbytes >= TARGET[0] * MIB
    return {
        "mib": nbytes // MIB,
        "frame_bytes": frame,
        "put_ms": med["put"] * 1e3,
        "pull_ms": med["pull"] * 1e3,
        "put_pull_ms": (med["put"] + med["pull"]) * 1e3,
        "raw_nixl_ms": med["raw"] * 1e3,
        "raw_write_ms": write_ms,  # None: the raw WRITE failed (``raw_write_error``)
        "raw_best_ms": best * 1e3,
        "memcpy_ms": med["memcpy"] * 1e3,
        "pull_gbps": gbps["pull"],
        "raw_nixl_gbps": gbps["raw"],
        "raw_write_gbps": gbps.get("raw_write"),
        "memcpy_gbps": gbps["memcpy"],
        "pull_vs_raw": med["raw"] / med["pull"],
        "pull_vs_best": best / med["pull"],
        "put_pull_vs_raw": med["raw"] / (med["put"] + med["pull"]),
        "target": TARGET[1] if aimed else None,
        "meets_target": best / med["pull"] >= TARGET[1] if aimed else None,
        "repeats": repeats,
    }


def run(
    sizes: list[int], repeats: int, device: str = "cpu", direction: str = "auto"
) -> dict[str, Any]:
    torch.set_num_threads(1)  # a memcpy is one thread; OpenMP spinning would starve NIXL's
    pool = max(sizes) + 8 * MIB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(child, pool, device), daemon=True)
    proc.start()
    child.close()
    rows: list[dict[str, Any]] = []
    error = None
    try:
        info = _recv(parent, proc)
        endpoint = f"tcp://{info['host']}:{info['port']}"
        receiver = NixlPullConnector(_config("receiver", pool, device, direction))
        raw = RawReader(pool, device)
        try:
            for nbytes in sizes:
                samples: dict[str, list[float]] = {k: [] for k in SAMPLES}
                frame, write_error = 0, None
                for rep in range(repeats + 1):
                    parent.send(("put", f"b{nbytes}-{rep}", nbytes))
                    meta, put_s, frame, ok = _recv(parent, proc)
                    assert ok
                    agent_name = str(meta["session"]).rpartition("@")[0]
                    src = int(meta["src_addr"])
                    raw_s = raw.read(endpoint, agent_name, src, frame)
                    parent.send(("raw_write", raw.md, raw.buf.data_ptr(), src, frame))
                    write_s = _recv(parent, proc)
                    if isinstance(write_s, str):
                        write_error = write_s
                    t0 = time.perf_counter()
                    got = receiver.get("0", "1", f"b{nbytes}-{rep}", meta)
                    pull_s = time.perf_counter() - t0
                    assert got is not None and got[0]["kv"].numel() == nbytes
                    del got
                    if rep:  # the first round warms pools, connections and caches
                        samples["put"].append(put_s)
                        samples["pull"].append(pull_s)
                        samples["raw"].append(raw_s)
                        if not isinstance(write_s, str):
                            samples["raw_write"].append(write_s)
                        samples["memcpy"].append(_memcpy_s(frame, device))
                med = {k: statistics.median(v) for k, v in samples.items() if v}
                rows.append({**_row(nbytes, frame, med, repeats), "raw_write_error": write_error})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            raw.close()
            receiver.close()
    except Exception as e:  # the rows measured so far are kept, with what stopped the run
        error = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(OSError):  # a dead sender's pipe is closed
            parent.send(("exit",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            # other work on the host skews every column; recorded so runs can be compared
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "ucx_tls": os.environ.get("UCX_TLS"),  # None: UCX picks its transports
        # who posts the pull: the receiver READs, or the sender WRITEs (auto: WRITE for VRAM)
        "nixl_direction": direction,
        "rows": rows,
        "error": error,
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    """Draw the rows into ``path``; False without matplotlib (the GPU machine)."""
    rows = result["rows"]
    series = [
        (label, [r[key] or 0 for r in rows])
        for key, label in (
            ("memcpy_gbps", "memcpy (same bytes)"),
            ("raw_nixl_gbps", "raw NIXL READ"),
            ("raw_write_gbps", "raw NIXL WRITE"),
            ("pull_gbps", "nixl backend pull (get)"),
        )
    ]
    put_pull = [r["frame_bytes"] / (r["put_pull_ms"] / 1e3) / 1e9 for r in rows]
    series.append(("nixl backend put + pull", put_pull))
    labels = [f"{r['mib']} MiB" for r in rows]
    title = "NIXL/UCX on one host: backend vs raw engine vs memcpy"
    ylabel = "GB/s (frame bytes / median time)"
    return grouped_bars(path, labels, series, ylabel, title, width=7.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 MiB, 2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the pools are")
    ap.add_argument("--sizes", type=int, nargs="+", help="MiB (default 16 64 256)")
    ap.add_argument("--name", help="file name without extension (default nixl_bench[_quick])")
    ap.add_argument(
        "--direction", default="auto", choices=["auto", "read", "write"], help="nixl_direction"
    )
    a = ap.parse_args()
    sizes = [1 * MIB, 4 * MIB] if a.quick else [m * MIB for m in a.sizes or [16, 64, 256]]
    result = run(sizes, 2 if a.quick else a.repeats, a.device, a.direction)
    a.out.mkdir(parents=True, exist_ok=True)
    name = a.name or ("nixl_bench_quick" if a.quick else "nixl_bench")
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    drawn = plot(result, a.out / f"{name}.png") if result["rows"] else False
    print(f"wrote {a.out / name}.json" + (" and .png" if drawn else " (no plot)"))
    if result["error"]:
        sys.exit(f"nixl_bench stopped: {result['error']}")


if __name__ == "__main__":
    main()
