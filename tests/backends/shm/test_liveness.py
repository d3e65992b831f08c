"""Shared-memory liveness across PID namespaces (heartbeats) and reclaim from dead readers.

Real processes and real ``/dev/shm``: a producer in a separate PID namespace
(``unshare --pid --fork``, root only) whose pid means nothing here, constructed
headers for the cases a namespace cannot be made for, and consumers killed with
SIGKILL after claiming a segment.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from _mp import CTX
from _planted import dead_pid, plant_segment

from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector
from vllm_omni_kv.backends.shm import arena as shm_arena
from vllm_omni_kv.backends.shm.connector import index_name
from vllm_omni_kv.backends.shm.liveness import (
    W_PIDNS,
    now_ms,
    owner_alive,
    pid_alive,
    pid_namespace,
)

STALE = 3.0  # heartbeat_stale_s of these tests (the smallest allowed)
WAIT = 60.0  # generous bound for anything that must happen "within the threshold"


def _payload(seed: int) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(300, 4, 64, generator=g) for _ in range(2)]
    return KVCacheTransferData("r", {"key_cache": k, "value_cache": k}, [0], {"seed": seed})


def _until(cond: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _files(ns: str) -> set[str]:
    return shm_arena.namespace_files(ns)


def _sweep(ns: str) -> list[str]:
    """Sweep (every orphan of this host goes) and return what was removed of ``ns``."""
    tag = shm_arena.namespace_tag(ns)
    return sorted(n for n in shm_arena.sweep_orphans(STALE) if f"_{tag}_" in n)


def _segments(ns: str) -> list[str]:
    return sorted(n for n in _files(ns) if n.startswith(shm_arena.SEG_PREFIX))


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return f"lv{os.getpid()}_{request.node.name[:40]}"


# -- a real second PID namespace ----------------------------------------------------------
PRODUCER = textwrap.dedent(
    """
    import os, sys, torch
    from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector
    ns = sys.argv[1]
    conn = SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": 3.0})
    def payload(seed):
        g = torch.Generator().manual_seed(seed)
        k = [torch.randn(300, 4, 64, generator=g) for _ in range(2)]
        return KVCacheTransferData("r", {"key_cache": k, "value_cache": k}, [0], {"seed": seed})
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "put":
            conn.put("0", "1", cmd[1], payload(int(cmd[2])))
            print("pid", os.getpid(), flush=True)
        elif cmd[0] == "close":
            conn.close()
            print("closed", flush=True)
    """
)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30, check=False
    )
    return r.returncode == 0


@pytest.fixture
def namespaced_producer(ns: str):
    """A producer process in a PID namespace of its own (pid 1 there)."""
    if not _unshare_works():
        pytest.skip("unshare --pid needs root (CAP_SYS_ADMIN)")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", PRODUCER, ns],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def send(line: str) -> str:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        yield proc, send
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        shm_arena.sweep_orphans(STALE)  # what the killed producer left (its beat is stale)


def test_producer_in_another_pid_namespace_is_alive_then_dead_by_its_heartbeat(
    ns: str, namespaced_producer
) -> None:
    proc, send = namespaced_producer
    assert send("put a 1") == "pid 1"  # pid 1 in its namespace: here pid 1 is init
    seg = _segments(ns)[0]
    assert seg.startswith(f"{shm_arena.SEG_PREFIX}1_")
    words = shm_arena.read_header(seg)
    assert words is not None and words[W_PIDNS] not in (0, pid_namespace())
    assert pid_alive(1)  # what kill(pid, 0) said: alive, but about an unrelated process
    # Its heartbeat keeps everything in place past the staleness threshold...
    time.sleep(STALE + 1.5)
    assert _sweep(ns) == []
    assert seg in _files(ns) and index_name(ns, "0", "1", "a") in _files(ns)
    # ... and a reader here loads it bit-exactly.
    with SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE}) as rx:
        got = rx.get("0", "1", "a")
        assert got is not None
        ref = _payload(1)
        assert all(
            torch.equal(t, want)
            for t, want in zip(got[0]["layer_blocks"]["key_cache"], ref.layer_blocks["key_cache"])
        )
        del got
    assert send("put b 2") == "pid 1"
    seg_b = shm_arena.read_header(seg)
    assert seg_b is not None and owner_alive(seg_b, 1, STALE)
    # Killed: the pid here still looks alive (init), the heartbeat stops. Once it is stale,
    # readers call the producer dead and the sweep removes its files.
    left = _files(ns)
    assert index_name(ns, "0", "1", "b") in left
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)

    def all_dead() -> bool:
        return not any(owner_alive(shm_arena.read_header(s) or [], 1, STALE) for s in _segments(ns))

    assert _until(all_dead)
    assert pid_alive(1)
    assert set(_sweep(ns)) == left
    assert _files(ns) == set()


def test_a_namespaced_producer_that_closes_leaves_nothing(ns: str, namespaced_producer) -> None:
    _proc, send = namespaced_producer
    send("put a 3")
    assert _files(ns)
    assert send("close") == "closed"
    assert _files(ns) == set()


# -- constructed headers: the cases one namespace cannot produce ----------------------------


def test_nonexistent_pid_with_a_fresh_heartbeat_from_another_namespace_is_kept(ns: str) -> None:
    # Before heartbeats, a pid unknown here meant "dead": the sweep deleted a live
    # container's files. A fresh beat from another PID namespace keeps them.
    pid = dead_pid()
    name = plant_segment(ns, pid, now_ms(), ident=1)
    try:
        assert not pid_alive(pid)
        assert _sweep(ns) == []
        assert owner_alive(shm_arena.read_header(name) or [], pid, STALE)
    finally:
        shm_arena.unlink_quiet(name)


def test_same_namespace_dead_pid_is_dead_at_once_despite_a_fresh_beat(ns: str) -> None:
    name = plant_segment(ns, dead_pid(), now_ms(), ident=pid_namespace())
    assert _sweep(ns) == [name]


def test_live_but_unrelated_pid_with_a_stale_heartbeat_is_swept(ns: str) -> None:
    # pid reuse (or another namespace's pid that happens to exist here): kill(pid, 0)
    # says alive forever; the stale beat says dead.
    stale = now_ms() - int((STALE + 60) * 1000)
    mine = plant_segment(ns, os.getppid(), stale, ident=pid_namespace())
    theirs = plant_segment(ns, 1, stale - 1, ident=1)
    assert pid_alive(os.getppid()) and pid_alive(1)
    assert _sweep(ns) == sorted([mine, theirs])


def test_stopped_heartbeat_goes_stale_and_only_then_is_swept(ns: str) -> None:
    conn = SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE})
    try:
        conn.put("0", "1", "k", _payload(5))
        seg = _segments(ns)[0]
        # pretend the owner lives in another PID namespace: only its beat can tell
        fd = os.open(shm_arena.path(seg), os.O_RDWR)
        try:
            os.pwrite(fd, np.array([7], dtype="<u8").tobytes(), W_PIDNS * 8)
        finally:
            os.close(fd)
        time.sleep(STALE + 1.5)  # the heartbeat thread keeps it fresh
        assert _sweep(ns) == []
        conn._arena._stop.set()  # the producer hangs: no more beats
        conn._arena._beater.join(10)  # type: ignore[union-attr]
        assert _until(lambda: seg in _sweep(ns))
        assert index_name(ns, "0", "1", "k") not in _files(ns)  # its entry went with it
    finally:
        conn.close()


# -- readers killed after claiming ---------------------------------------------------------
def _claim_and_hang(ns: str, key: str, q) -> None:
    conn = SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE})
    deadline = time.monotonic() + 60
    got = None
    while got is None and time.monotonic() < deadline:
        got = conn.get("0", "1", key)
        time.sleep(0.01)
    q.put("claimed" if got is not None else "missing")
    time.sleep(600)  # holds the tensor views (and its lease) until killed


def _state(name: str) -> int:
    words = shm_arena.read_header(name)
    assert words is not None
    return words[0]


@pytest.mark.parametrize("pooled", [True, False])
def test_reader_killed_after_claiming_gives_the_segment_back(ns: str, pooled: bool) -> None:
    cfg = {"namespace": ns, "heartbeat_stale_s": STALE}
    if not pooled:
        cfg["pool_max_bytes"] = 0  # one-off segments, which the reader would unlink
    with SharedMemoryConnector(cfg) as tx:
        tx.put("0", "1", "k", _payload(7))
        seg = _segments(ns)[0]
        q = CTX.Queue()
        reader = CTX.Process(target=_claim_and_hang, args=(ns, "k", q))
        reader.start()
        try:
            assert q.get(timeout=WAIT) == "claimed"
            assert index_name(ns, "0", "1", "k") not in _files(ns)
            # a live reader renews its lease: the producer leaves the segment alone
            time.sleep(2 * STALE)
            assert tx.health()["reclaimed"] == 0
            assert _state(seg) == (shm_arena.PUBLISHED if pooled else shm_arena.ONESHOT)
            os.kill(reader.pid, signal.SIGKILL)
            reader.join(30)
            assert _until(lambda: tx.health()["reclaimed"] == 1)
        finally:
            if reader.is_alive():
                os.kill(reader.pid, signal.SIGKILL)
                reader.join(30)
        if pooled:
            assert _state(seg) == shm_arena.FREE
            tx.put("0", "1", "k2", _payload(8))  # the segment is reused, no new one
            assert _segments(ns) == [seg]
            assert tx.get("0", "1", "k2") is not None
        else:
            assert _segments(ns) == []  # the producer unlinked the one-off segment
    assert _files(ns) == set()


def test_claim_without_a_lease_is_reclaimed_after_the_threshold(ns: str) -> None:
    # A reader killed between renaming the index entry and writing its lease.
    with SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE}) as tx:
        tx.put("0", "1", "k", _payload(9))
        seg = _segments(ns)[0]
        assert shm_arena.claim_index(index_name(ns, "0", "1", "k")) is not None
        assert _until(lambda: tx.health()["reclaimed"] == 1)
        assert _state(seg) == shm_arena.FREE


def test_health_counts_the_bytes_of_unconsumed_payloads() -> None:
    """What the bytes-held gauge reads: the frame bytes of entries nobody claimed yet."""
    ns = f"held-{os.getpid()}-{time.monotonic_ns()}"
    prod = SharedMemoryConnector({"namespace": ns})
    cons = SharedMemoryConnector({"namespace": ns})
    try:
        ok, size, _ = prod.put("a", "b", "k1", torch.zeros(1 << 20, dtype=torch.uint8))
        ok2, size2, _ = prod.put("a", "b", "k2", torch.ones(300_000, dtype=torch.uint8))
        assert ok and ok2
        h = prod.health()
        assert h["unconsumed"] == 2 and h["held_bytes"] == size + size2
        got = cons.get("a", "b", "k1")
        assert got is not None
        del got
        h = prod.health()
        assert h["unconsumed"] == 1 and h["held_bytes"] == size2
    finally:
        cons.close()
        prod.close()


def _put_small_then_wait(ns: str, q) -> None:
    tx = SharedMemoryConnector({"namespace": ns})
    tx.put("a", "b", "small", torch.arange(16))  # under shm_threshold_bytes: inline
    q.put("published")
    time.sleep(60)


def test_inline_entries_of_a_killed_producer_are_swept(ns: str) -> None:
    # a small payload travels inside its index entry, which names its producer's pid
    q = CTX.Queue()
    proc = CTX.Process(target=_put_small_then_wait, args=(ns, q))
    proc.start()
    try:
        assert q.get(timeout=WAIT) == "published"
        entry = index_name(ns, "a", "b", "small")
        assert entry in _files(ns)
        assert entry not in _sweep(ns)  # its producer is alive
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert entry in _sweep(ns)
    assert not _files(ns)
