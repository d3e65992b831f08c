"""An owner in our PID namespace is alive while its pid runs with its start time, however
old its heartbeat: a paused producer keeps its payloads through a neighbour's sweep.

Real processes and real ``/dev/shm`` for the pause (SIGSTOP past the staleness, a
neighbour's connector start, SIGCONT, a bit-exact read) and the kill; planted headers,
built from the documented ``ident`` layout and ``/proc`` read here, for pid reuse,
foreign namespaces and unknown layouts.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import numpy as np
import torch
from _mp import CTX
from _planted import dead_pid, plant_segment

from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector, shm_inventory
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.liveness import W_BEAT, W_PIDNS, now_ms, owner_alive

STALE = 3.0  # heartbeat_stale_s here (the smallest allowed): the pause outlasts it
NBYTES = 2 << 20  # the producer's shared KV cache (above the 1 MiB a cache must reach)


def _payload(seed: int) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(300, 4, 64, generator=g) for _ in range(2)]
    return KVCacheTransferData("r", {"key_cache": k, "value_cache": k}, [0], {"seed": seed})


def _cache_bytes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (NBYTES,), generator=g, dtype=torch.uint8)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _mine(ns: str, names: list[str]) -> set[str]:
    return {n for n in names if f"_{arena.namespace_tag(ns)}_" in n}


def _producer(ns: str, conn: Any) -> None:
    """Publish a segment payload, an inline one and a hold on shared cache pages; wait."""
    tx = SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE})
    region = tx.cache_region
    assert region is not None
    kv = region.allocate(NBYTES)
    assert kv is not None, region.unavailable_reason
    kv.view(torch.uint8).copy_(_cache_bytes(3))
    tx.put("p", "d", "big", _payload(1))
    tx.put("p", "d", "small", torch.arange(16))  # under shm_threshold_bytes: inline
    hold = region.hold("p", "d", "pages")
    desc = {"kind": "shm", "name": region.owner_name, "owner": region.producer.instance}
    conn.send((desc, hold))
    conn.recv()  # until told to close (or killed)
    tx.close()
    conn.send("closed")


def test_a_paused_producer_keeps_its_payloads_through_a_neighbours_sweep(ns: str) -> None:
    mine, theirs = CTX.Pipe()
    proc = CTX.Process(target=_producer, args=(ns, theirs), daemon=True)
    proc.start()
    try:
        assert mine.poll(60), "the producer did not publish"
        desc, hold = mine.recv()
        files = arena.namespace_files(ns)
        segs = [n for n in files if n.startswith(arena.SEG_PREFIX)]
        assert len(segs) == 2 and hold in files  # the payload's segment, the cache's
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(STALE + 1.5)
        for seg in segs:  # every heartbeat is past the staleness: by age alone, all dead
            words = arena.read_header(seg)
            assert words is not None and now_ms() - words[W_BEAT] > STALE * 1000
        assert shm_inventory(ns, stale_s=STALE).orphans == 0
        with SharedMemoryConnector({"namespace": ns, "heartbeat_stale_s": STALE}) as rx:
            assert not _mine(ns, arena.sweep_orphans(STALE))  # its start swept too
            assert arena.namespace_files(ns) == files
            os.kill(proc.pid, signal.SIGCONT)
            got = rx.get("p", "d", "big")
            assert got is not None
            ref = _payload(1).layer_blocks
            for name in ("key_cache", "value_cache"):
                assert [_sha(t) for t in got[0]["layer_blocks"][name]] == [
                    _sha(t) for t in ref[name]
                ]
            del got
            small = rx.get("p", "d", "small")
            assert small is not None and torch.equal(small[0], torch.arange(16))
            region = rx.cache_region
            assert region is not None
            view = region.attach(desc)
            with region.reading(hold):
                copied = view[:NBYTES].clone()
            assert _sha(copied) == _sha(_cache_bytes(3))
            del view
            region.close()
            # Killed (and reaped), it is dead at once, although its heartbeat is fresh.
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            left = arena.namespace_files(ns)
            assert left and _mine(ns, arena.sweep_orphans(STALE)) == left
            assert arena.namespace_files(ns) == set()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.join(30)


# -- planted headers: the ident word built by hand from its documented layout ----------------
def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22


def _ident(start: int, ns_inode: int, layout: int = 1) -> int:
    folded = (ns_inode ^ (ns_inode >> 32)) & 0xFFFFFFFF
    return layout << 62 | (start & (2**30 - 1)) << 32 | folded


OUR_NS = os.stat("/proc/self/ns/pid").st_ino


def test_pid_start_time_and_namespace_decide_and_heartbeats_only_across(ns: str) -> None:
    me, parent, dead = os.getpid(), os.getppid(), dead_pid()
    stale_s = 60.0  # the sweep's threshold here: "fresh" stays fresh on a loaded machine
    old, now = now_ms() - int((stale_s + 60) * 1000), now_ms()  # a beat long stale, one fresh
    keep = {
        # our namespace, pid running with that start time: alive whatever its heartbeat
        plant_segment(ns, me, old, _ident(_start_ticks(me), OUR_NS), "same_stale"),
        plant_segment(ns, parent, 0, _ident(_start_ticks(parent), OUR_NS), "same_nobeat"),
        # another namespace (its pid means nothing here): a fresh heartbeat keeps it
        plant_segment(ns, dead, now, _ident(5, OUR_NS + 1), "other_fresh"),
        # an unknown layout: foreign, judged by its heartbeat
        plant_segment(ns, dead, now, _ident(_start_ticks(me), OUR_NS, 2), "unk_fresh"),
        # a pid no process can have says nothing: its heartbeat decides
        plant_segment(ns, 0, now, _ident(_start_ticks(me), OUR_NS), "pid0_fresh"),
    }
    swept = {
        # a reused pid: the pid runs, but started at another time
        plant_segment(ns, me, now, _ident(_start_ticks(me) + 1, OUR_NS), "reused"),
        plant_segment(ns, dead, now, _ident(7, OUR_NS), "dead"),
        # another namespace with a stale heartbeat, whatever runs here under that pid
        plant_segment(ns, me, old, _ident(_start_ticks(me), OUR_NS + 1), "other_stale"),
        plant_segment(ns, me, old, _ident(_start_ticks(me), OUR_NS, 3), "unk_stale"),
        plant_segment(ns, 2**23, old, _ident(_start_ticks(me), OUR_NS), "bigpid_stale"),
    }
    try:
        assert _mine(ns, arena.sweep_orphans(stale_s)) == swept
        assert arena.namespace_files(ns) == keep
    finally:
        for name in keep | swept:
            arena.unlink_quiet(name)


def test_owner_alive_is_total_over_hostile_headers() -> None:
    rng = np.random.default_rng(31)
    pids: list[int | None] = [None, -1, 0, 1, os.getpid(), 2**22 + 1, 2**63, dead_pid()]
    specials = [0, 2**64 - 1, 1 << 62, 3 << 62, _ident(0, OUR_NS), OUR_NS]
    for i in range(400):
        words = [int(w) for w in rng.integers(0, 2**63, 8, dtype=np.uint64) * 2]
        words[W_PIDNS] = specials[i % len(specials)] if i % 3 else words[W_PIDNS]
        words[W_BEAT] = [0, now_ms(), 2**64 - 1, words[W_BEAT]][i % 4]
        for pid in pids:
            assert owner_alive(words, pid, STALE) in (True, False)
    assert owner_alive([], os.getpid(), STALE) is False  # no header: no owner


def test_an_owner_seen_alive_is_dead_as_soon_as_it_exits() -> None:
    """After the first check, later ones poll a pidfd: still exact, and none is left open."""
    proc = CTX.Process(target=time.sleep, args=(120,))
    proc.start()
    try:
        fds = len(os.listdir("/proc/self/fd"))
        words = [0] * arena.SLOT_WORDS
        words[W_BEAT] = now_ms() - int((STALE + 60) * 1000)  # stale: only the pid can tell
        words[W_PIDNS] = _ident(_start_ticks(proc.pid), OUR_NS)
        assert all(owner_alive(words, proc.pid, STALE) for _ in range(3))
        reused = list(words)
        reused[W_PIDNS] = _ident(_start_ticks(proc.pid) - 1, OUR_NS)
        assert not owner_alive(reused, proc.pid, STALE)  # same pid, another start time
        os.kill(proc.pid, signal.SIGSTOP)  # stopped is alive
        assert owner_alive(words, proc.pid, STALE)
        proc.kill()
        proc.join(30)
        assert not owner_alive(words, proc.pid, STALE)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(30)
