"""SharedMemoryConnector against real /dev/shm and real processes."""

from __future__ import annotations

import gc
import os
import signal
import stat
import time

import msgpack
import pytest
import torch
from _mp import CTX

from vllm_omni_kv import KVCacheTransferData, KVPayloadError, KVTransferError, SharedMemoryConnector
from vllm_omni_kv.backends.shm import arena as shm_arena
from vllm_omni_kv.backends.shm.connector import index_name


def _payload(seq: int = 300) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(seq)
    k = [torch.randn(seq, 4, 64, generator=g) for _ in range(2)]
    v = [torch.randn(seq, 4, 64, generator=g) for _ in range(2)]
    return KVCacheTransferData("r1", {"key_cache": k, "value_cache": v}, [0, 1], {"seq_len": seq})


def _consume(ns: str, key: str, q, timeout: float = 20.0) -> None:
    conn = SharedMemoryConnector({"namespace": ns})
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            got = conn.get("0", "1", key)
            if got is not None:
                obj, size = got
                k = obj["layer_blocks"]["key_cache"]
                q.put(("ok", size, [t.numpy().tobytes() for t in k], obj["metadata"]))
                return
            time.sleep(0.005)
        q.put(("timeout", 0, None, None))
    except Exception as e:  # report to the parent instead of dying silently
        q.put(("error", 0, repr(e), None))
    finally:
        conn.close()


def _produce_and_hang(ns: str, key: str, ready) -> None:
    conn = SharedMemoryConnector({"namespace": ns})
    conn.put("0", "1", key, _payload())
    ready.set()
    time.sleep(120)


def _ours(pid: int, ns: str, keys: tuple[str, ...] = ("k",)) -> list[str]:
    """Arena files of process ``pid`` and index entries of ``keys`` in namespace ``ns`` (other
    processes on this host, e.g. vLLM workers, may own omnikv files of their own)."""
    idx = {index_name(ns, "0", "1", k) for k in keys}
    return [
        n
        for n in os.listdir(shm_arena.SHM_DIR)
        if n.startswith(f"{shm_arena.SEG_PREFIX}{pid}_") or n.split(".")[0] in idx
    ]


@pytest.fixture
def ns(request) -> str:
    return f"t{os.getpid()}_{request.node.name[:40]}"


def test_cross_process_round_trip_is_bit_exact(ns):
    data = _payload()
    q = CTX.Queue()
    proc = CTX.Process(target=_consume, args=(ns, "k", q))
    proc.start()
    with SharedMemoryConnector({"namespace": ns}) as prod:
        ok, size, meta = prod.put("0", "1", "k", data)
        assert ok and size > 0 and meta["size"] == size and "inline" not in meta
        status, got_size, keys, md = q.get(timeout=60)
        proc.join(30)
    assert status == "ok" and got_size == size and md == {"seq_len": 300}
    for a, b in zip(data.layer_blocks["key_cache"], keys, strict=True):
        assert a.numpy().tobytes() == b


def test_views_point_into_shared_memory_and_segment_is_recycled(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "a", _payload())
        obj, _ = conn.get("0", "1", "a")
        seg_files = [
            n
            for n in os.listdir(shm_arena.SHM_DIR)
            if n.startswith(shm_arena.SEG_PREFIX + str(os.getpid()))
        ]
        assert len(seg_files) == 1
        arena_bytes = conn.health()["arena_bytes"]
        del obj
        gc.collect()
        for i in range(20):  # reuse: the arena does not grow
            conn.put("0", "1", f"b{i}", _payload())
            got = conn.get("0", "1", f"b{i}")
            assert got is not None
            del got
        assert conn.health()["arena_bytes"] == arena_bytes


def test_segments_are_prefaulted_where_the_os_can():
    """Arena segments and readers' mappings ask for MAP_POPULATE (no page faults on the data path)."""
    import mmap

    assert shm_arena.POPULATE == getattr(mmap, "MAP_POPULATE", 0)
    if hasattr(mmap, "MAP_POPULATE"):
        assert shm_arena.POPULATE != 0


def test_segments_are_owner_only(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "k", _payload())
        ours = [n for n in os.listdir(shm_arena.SHM_DIR) if n.startswith("omnikv_")]
        assert ours
        for n in ours:
            assert stat.S_IMODE(os.stat(f"{shm_arena.SHM_DIR}/{n}").st_mode) == 0o600


def test_small_payload_travels_inline(ns):
    with SharedMemoryConnector({"namespace": ns, "shm_threshold_bytes": 1 << 20}) as conn:
        ok, size, meta = conn.put("0", "1", "small", {"x": torch.arange(10)})
        assert ok and size < (1 << 20) and isinstance(meta["inline"], bytes)
        assert not [
            n
            for n in os.listdir(shm_arena.SHM_DIR)
            if n.startswith(shm_arena.SEG_PREFIX + str(os.getpid()))
        ]
        obj, _ = conn.get("0", "1", "small")
        assert torch.equal(obj["x"], torch.arange(10))


def test_missing_key_returns_none_and_exactly_one_reader_wins(ns):
    with (
        SharedMemoryConnector({"namespace": ns}) as a,
        SharedMemoryConnector({"namespace": ns}) as b,
    ):
        assert a.get("0", "1", "nope") is None
        a.put("0", "1", "k", b"x" * 100_000)
        first, second = b.get("0", "1", "k"), a.get("0", "1", "k")
        assert first is not None and second is None
        assert first[0] == b"x" * 100_000


def test_edges_and_namespaces_isolate_keys(ns):
    with (
        SharedMemoryConnector({"namespace": ns}) as a,
        SharedMemoryConnector({"namespace": ns + "x"}) as b,
    ):
        a.put("0", "1", "k", b"edge01")
        assert a.get("1", "2", "k") is None
        assert b.get("0", "1", "k") is None
        assert a.get("0", "1", "k")[0] == b"edge01"


def test_duplicate_unconsumed_key_is_rejected(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "k", b"1")
        with pytest.raises(KVTransferError, match="already published"):
            conn.put("0", "1", "k", b"2")


def test_cleanup_withdraws_matching_keys_only(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        for key in ("req7_0_0_0_0", "req7", "x_req7", "req70_0"):
            conn.put("0", "1", key, torch.zeros(100_000))
        conn.cleanup("req7")
        assert conn.get("0", "1", "req7_0_0_0_0") is None
        assert conn.get("0", "1", "req7") is None
        assert conn.get("0", "1", "x_req7") is None
        assert conn.get("0", "1", "req70_0") is not None


def test_ttl_expires_unconsumed_entries(ns):
    with SharedMemoryConnector({"namespace": ns, "ttl_seconds": 0.2}) as conn:
        conn.put("0", "1", "old", torch.zeros(100_000))
        time.sleep(1.1)
        conn.put("0", "1", "new", torch.zeros(100_000))
        assert conn.get("0", "1", "old") is None
        assert conn.get("0", "1", "new") is not None


def test_close_is_idempotent_and_removes_everything(ns):
    conn = SharedMemoryConnector({"namespace": ns})
    conn.put("0", "1", "a", torch.zeros(1 << 20))
    conn.put("0", "1", "b", b"tiny")
    conn.close()
    conn.close()
    assert conn.health()["status"] == "closed"
    assert not _ours(os.getpid(), ns, ("a", "b"))
    with pytest.raises(KVTransferError, match="closed"):
        conn.put("0", "1", "c", b"x")


def test_corrupt_segment_is_reported_not_returned(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "k", _payload())
        seg = [
            n
            for n in os.listdir(shm_arena.SHM_DIR)
            if n.startswith(shm_arena.SEG_PREFIX + str(os.getpid()))
        ][0]
        with open(f"{shm_arena.SHM_DIR}/{seg}", "r+b") as f:
            f.seek(shm_arena.DATA_OFFSET + 5000)
            b = f.read(1)
            f.seek(shm_arena.DATA_OFFSET + 5000)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(KVPayloadError, match="checksum"):
            conn.get("0", "1", "k")
        # the segment went back to the arena: a new transfer reuses it
        conn.put("0", "1", "k2", _payload())
        assert conn.get("0", "1", "k2") is not None


def test_truncated_index_entry_is_reported(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "k", _payload())
        path = shm_arena.SHM_DIR + "/" + index_name(ns, "0", "1", "k")
        with open(path, "r+b") as f:
            f.truncate(3)
        with pytest.raises(KVPayloadError):
            conn.get("0", "1", "k")


def test_killed_producer_leaves_nothing_after_sweep(ns):
    ready = CTX.Event()
    proc = CTX.Process(target=_produce_and_hang, args=(ns, "k", ready))
    proc.start()
    assert ready.wait(60)
    assert _ours(proc.pid, ns)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with SharedMemoryConnector({"namespace": ns}) as conn:  # construction sweeps orphans
        assert conn.get("0", "1", "k") is None  # the dead producer's entry is gone
    assert not _ours(proc.pid, ns)


def test_many_concurrent_keys_across_processes(ns):
    q = CTX.Queue()
    procs = [CTX.Process(target=_consume, args=(ns, f"k{i}", q)) for i in range(4)]
    for p in procs:
        p.start()
    with SharedMemoryConnector({"namespace": ns}) as prod:
        for i in range(4):
            prod.put("0", "1", f"k{i}", _payload(100 + i))
        results = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
    assert sorted(r[0] for r in results) == ["ok"] * 4
    assert sorted(r[3]["seq_len"] for r in results) == [100, 101, 102, 103]


def _dead_pid() -> int:
    proc = CTX.Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join(30)
    return proc.pid


def test_segment_of_another_user_is_refused(ns):
    with SharedMemoryConnector({"namespace": ns}) as conn:
        conn.put("0", "1", "k", _payload())
        seg = _ours(os.getpid(), ns)
        seg = [n for n in seg if n.startswith(shm_arena.SEG_PREFIX)][0]
        os.chown(f"{shm_arena.SHM_DIR}/{seg}", 4242, -1)  # as if another user had planted it
        try:
            with pytest.raises(KVTransferError, match="belongs to uid 4242"):
                conn.get("0", "1", "k")
        finally:
            os.chown(f"{shm_arena.SHM_DIR}/{seg}", os.getuid(), -1)


def test_index_naming_a_path_is_refused():
    from vllm_omni_kv.backends.shm.reader import parse_ref

    entry = b"R" + msgpack.packb(
        {
            "seg": shm_arena.SEG_PREFIX + "1/../../etc/passwd",
            "gen": 1,
            "size": 1,
            "pooled": True,
            "pid": 1,
        }
    )
    with pytest.raises(KVPayloadError, match="outside the arena"):
        parse_ref(entry)


def test_sweep_skips_what_it_must_not_or_cannot_remove(ns, monkeypatch, caplog):
    pid = _dead_pid()
    theirs = f"{shm_arena.SEG_PREFIX}{pid}_{ns}_theirs"
    stuck = f"{shm_arena.SEG_PREFIX}{pid}_{ns}_stuck"
    gone = f"{shm_arena.SEG_PREFIX}{pid}_{ns}_gone"
    for name in (theirs, stuck, gone):
        open(f"{shm_arena.SHM_DIR}/{name}", "wb").close()
    os.chown(f"{shm_arena.SHM_DIR}/{theirs}", 4242, -1)
    real_unlink = os.unlink

    def unlink(p, *a, **kw):
        if str(p).endswith(stuck):
            raise PermissionError(1, "Operation not permitted", str(p))
        return real_unlink(p, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    try:
        with caplog.at_level("WARNING"):
            removed = shm_arena.sweep_orphans()
        assert gone in removed and theirs not in removed and stuck not in removed
        assert os.path.exists(f"{shm_arena.SHM_DIR}/{theirs}")
        assert "left orphaned shared-memory file" in caplog.text
    finally:
        monkeypatch.undo()
        for name in (theirs, stuck, gone):
            if os.path.exists(f"{shm_arena.SHM_DIR}/{name}"):
                os.unlink(f"{shm_arena.SHM_DIR}/{name}")


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A 2 MiB tmpfs as the arena's directory (needs root to mount; skipped otherwise)."""
    import subprocess

    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    monkeypatch.setattr(shm_arena, "SHM_DIR", str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_shm_is_a_clean_error_not_a_sigbus(ns, small_shm):
    """Segments reserve their pages up front: no room is a KVTransferError at put time,
    nothing is left behind, and what fits still travels."""
    with SharedMemoryConnector({"namespace": ns, "max_bytes": 64 << 20}) as conn:
        big = KVCacheTransferData("r", {"x": [torch.zeros(4 << 20, dtype=torch.uint8)]}, [], {})
        with pytest.raises(KVTransferError, match="has no room.*--shm-size"):
            conn.put("0", "1", "big", big)
        assert os.listdir(small_shm) == []
        conn.put("0", "1", "k", _payload())
        got = conn.get("0", "1", "k")
        assert got is not None and got[0]["metadata"]["seq_len"] == 300
