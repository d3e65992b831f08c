"""The inventory of a shared-memory namespace against the files the real backend makes in
/dev/shm (one namespace per test): payloads published and claimed, cache segments and
holds, a SIGKILLed producer's orphans, files that vanish or are no files of ours, and
the ``vllm-omni-kv inventory`` command."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _mp import CTX

import vllm_omni_kv
from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector, ShmInventory, shm_inventory
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.cache_region import KV_OFFSET, ShmCacheRegion
from vllm_omni_kv.backends.shm.connector import index_name
from vllm_omni_kv.backends.shm.inventory import inventory
from vllm_omni_kv.backends.shm.producer import ProducerArena

REPO = Path(vllm_omni_kv.__file__).resolve().parents[1]
NBYTES = 3 << 20  # a KV cache allocation (at least 1 MiB)


def _payload(seed: int, rows: int = 300) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(rows, 4, 64, generator=g) for _ in range(2)]
    return KVCacheTransferData("r", {"key_cache": k, "value_cache": k}, [0], {"seed": seed})


def _file_bytes(ns: str) -> int:
    return sum(os.stat(arena.path(n)).st_size for n in arena.namespace_files(ns))


def test_a_published_payload_counts_until_it_is_claimed(ns: str) -> None:
    assert shm_inventory is inventory
    empty = inventory(ns)
    assert empty == ShmInventory(ns, arena.SHM_DIR) and empty.files == 0
    prod = SharedMemoryConnector({"namespace": ns, "stream": False})
    cons = SharedMemoryConnector({"namespace": ns})
    try:
        ok, size, _ = prod.put("0", "1", "big", _payload(1))
        _, small, meta = prod.put("0", "1", "small", _payload(2, rows=1))
        assert ok and size > 65536 > small and meta and "inline" in meta
        inv = inventory(ns)
        assert (inv.payloads, inv.payload_bytes) == (2, size + small)
        assert prod.health()["held_bytes"] == size + small
        assert (inv.segments, inv.segments_in_use, inv.segments_free) == (1, 1, 0)
        assert inv.segment_states["published"] == 1
        (seg,) = (n for n in arena.namespace_files(ns) if arena.file_kind(n) == "segment")
        assert inv.segment_bytes == os.stat(arena.path(seg)).st_size >= size + arena.DATA_OFFSET
        assert inv.files == 3 and inv.bytes == _file_bytes(ns)
        assert inv.caches == inv.holds == inv.orphans == inv.transient == inv.foreign == 0

        got = cons.get("0", "1", "big")  # claimed: the reader holds the segment
        assert got is not None
        held = inventory(ns)
        assert (held.payloads, held.payload_bytes) == (1, small)
        assert held.segments_in_use == 1 and held.segment_states["published"] == 1
        del got
        gc.collect()  # the last view goes: the segment returns to its producer's pool
        assert cons.get("0", "1", "small") is not None
        done = inventory(ns)
        assert (done.payloads, done.payload_bytes) == (0, 0)
        assert (done.segments, done.segments_free, done.segments_in_use) == (1, 1, 0)
        assert done.segment_states["free"] == 1 and done.files == 1
    finally:
        cons.close()
        prod.close()
    assert inventory(ns).files == 0


def test_an_exported_cache_and_its_holds(ns: str) -> None:
    pa = ProducerArena(0, namespace=ns)
    region = ShmCacheRegion(ns, pa, arena.STALE_S)
    try:
        with region.allocation_context():
            torch.zeros(NBYTES, dtype=torch.int8)
        inv = inventory(ns)
        assert (inv.caches, inv.cache_bytes) == (1, KV_OFFSET + NBYTES)
        assert inv.segments == inv.payloads == inv.holds == 0 and inv.files == 1
        holds = [region.hold("p", "d", f"k{i}") for i in range(2)]
        assert inventory(ns).holds == 2
        region.release(holds[0])
        assert inventory(ns).holds == 1
        assert region.take_back(holds[1])
        inv = inventory(ns)
        assert inv.holds == 0 and inv.caches == 1 and inv.orphans == 0
    finally:
        region.close()
        pa.close()
    assert inventory(ns).files == 0


def _doomed_producer(ns: str, conn: Any) -> None:
    prod = SharedMemoryConnector({"namespace": ns, "stream": False})
    prod.put("0", "1", "k", _payload(3))
    conn.send("published")
    conn.recv()  # SIGKILLed while waiting


def test_files_of_a_killed_producer_are_orphans_until_swept(ns: str) -> None:
    mine, theirs = CTX.Pipe()
    p = CTX.Process(target=_doomed_producer, args=(ns, theirs), daemon=True)
    p.start()
    try:
        assert mine.poll(120) and mine.recv() == "published"
        live = inventory(ns)
        assert live.payloads == 1 and live.segments_in_use == 1 and live.orphans == 0
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        dead = inventory(ns)
        assert dead.orphans == 2 == dead.files  # the segment and the index entry naming it
        assert dead.payloads == 1  # still published: only the sweep removes it
        tag = arena.namespace_tag(ns)
        swept = [n for n in arena.sweep_orphans() if f"_{tag}_" in n]
        assert len(swept) == dead.orphans
        assert inventory(ns) == ShmInventory(ns, arena.SHM_DIR)
    finally:
        if p.is_alive():
            p.kill()
            p.join(30)


def test_a_file_that_vanishes_during_the_scan_is_left_out(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prod = SharedMemoryConnector({"namespace": ns})
    try:
        prod.put("0", "1", "a", _payload(4, rows=1))
        prod.put("0", "1", "b", _payload(5, rows=1))
        listed = arena.namespace_files(ns)
        gone = index_name(ns, "0", "1", "a")
        real = arena.namespace_files

        def listed_then_unlinked(namespace: str) -> set[str]:
            names = real(namespace)
            if namespace == ns:  # removed between the listing and the read
                arena.unlink_quiet(gone)
            return names

        monkeypatch.setattr(arena, "namespace_files", listed_then_unlinked)
        inv = inventory(ns)
        assert len(listed) == 2 and inv.payloads == inv.files == 1
    finally:
        prod.close()


def test_inventory_while_another_thread_publishes_and_claims(ns: str) -> None:
    prod = SharedMemoryConnector({"namespace": ns})
    cons = SharedMemoryConnector({"namespace": ns})
    started, stop, errors = threading.Event(), threading.Event(), []

    def churn() -> None:
        try:
            i = 1  # odd: a payload in a segment first
            while not stop.is_set():
                prod.put("0", "1", f"k{i}", _payload(i, rows=40 if i % 2 else 1))
                started.set()
                assert cons.get("0", "1", f"k{i}") is not None
                i += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        assert started.wait(60), errors
        seen = [inventory(ns) for _ in range(200)]
    finally:
        stop.set()
        t.join(60)
        cons.close()
        prod.close()
    assert not errors, errors
    assert all(inv.payloads <= 1 and inv.orphans == 0 and inv.foreign == 0 for inv in seen)
    assert all(inv.segments >= 1 for inv in seen)  # the pooled segment stays once made


def test_links_fifos_and_claims_are_counted_without_reading_them(ns: str) -> None:
    tag = arena.namespace_tag(ns)
    link = arena.path(f"{arena.HOLD_PREFIX}{tag}_link")
    fifo = arena.path(f"{arena.SEG_PREFIX}{os.getpid()}_{tag}_fifo")
    claim = arena.path(f"{arena.IDX_PREFIX}{tag}_x.claim{os.getpid()}_0")
    try:
        os.symlink("/etc/passwd", link)
        os.mkfifo(fifo, 0o600)  # opening it for reading without O_NONBLOCK would block
        Path(claim).write_bytes(b"R")
        inv = inventory(ns)
        assert (inv.foreign, inv.transient, inv.files) == (2, 1, 3)
        assert inv.segments == inv.holds == inv.orphans == 0 and inv.bytes == 1
        assert inventory(ns, stale_s=0.0).orphans == 1  # a claim file older than stale_s
    finally:
        for f in (link, fifo, claim):
            Path(f).unlink(missing_ok=True)


def test_cli_inventory_json_equals_the_dataclass(ns: str) -> None:
    prod = SharedMemoryConnector({"namespace": ns, "stream": False})
    try:
        prod.put("0", "1", "k", _payload(6))
        # this tree's command (the console script may belong to another install)
        cmd = [sys.executable, "-m", "vllm_omni_kv.cli", "inventory", "--namespace", ns]
        run = {"capture_output": True, "text": True, "timeout": 120, "cwd": REPO}
        out = subprocess.run([*cmd, "--json"], **run)
        assert out.returncode == 0, out.stderr[-2000:]
        inv = inventory(ns)
        assert json.loads(out.stdout) == dataclasses.asdict(inv) and inv.payloads == 1
        table = subprocess.run(cmd, **run)
        assert table.returncode == 0 and table.stdout.strip() == inv.table()
        assert "payloads published, not claimed" in table.stdout
    finally:
        prod.close()
