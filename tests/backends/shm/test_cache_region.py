"""The producer's KV cache in shared memory and the hold files on its blocks, with real
processes and real /dev/shm (one namespace per test; nothing of it may remain)."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import os
import re
import stat
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _mp import CTX

from vllm_omni_kv.backends.cache_region import view_extent
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.cache_region import KV_OFFSET, ShmCacheRegion
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError

NBYTES = 3 << 20  # above the 1 MiB an allocation must reach to be the KV cache


def _region(ns: str) -> tuple[ShmCacheRegion, ProducerArena]:
    pa = ProducerArena(0, namespace=ns)
    return ShmCacheRegion(ns, pa, arena.STALE_S), pa


def _pattern(seed: int, n: int = NBYTES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _recv(conn: Any, timeout: float = 60.0) -> Any:
    assert conn.poll(timeout), "child process did not answer"
    return conn.recv()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


def _start(procs: list[Any], target: Any, *args: Any) -> tuple[Any, Any]:
    mine, theirs = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, theirs), daemon=True)
    p.start()
    procs.append(p)
    return p, mine


# -- child processes ---------------------------------------------------------------------
def _consumer(ns: str, desc: dict[str, Any], conn: Any) -> None:
    region, pa = _region(ns)
    try:
        conn.send(_sha(region.attach(desc)))
        conn.recv()  # the producer rewrote its cache
        conn.send(_sha(region.attach(desc)))
    except Exception as e:
        conn.send(f"error {type(e).__name__}: {e}")
    finally:
        region.close()
        pa.close()


def _reader(ns: str, hold: str, mode: str, conn: Any) -> None:
    region, pa = _region(ns)
    try:
        with region.reading(hold):
            conn.send("inside")
            if mode == "hang":
                time.sleep(120)
            conn.recv()
        conn.send("done")
    except Exception as e:
        conn.send(f"error {type(e).__name__}: {e}")
    finally:
        region.close()
        pa.close()


def _doomed_producer(ns: str, seed: int, conn: Any) -> None:
    region, pa = _region(ns)
    with region.allocation_context():
        kv = torch.zeros(NBYTES, dtype=torch.int8)
    kv.copy_(_pattern(seed))
    holds = [region.hold("p", "d", f"k{i}") for i in range(2)]
    conn.send(({"kind": "shm", "name": region.owner_name, "owner": pa.instance}, holds))
    time.sleep(120)  # SIGKILLed long before


# -- the cache segment -------------------------------------------------------------------
def test_allocation_context_moves_only_the_kv_cache(ns: str, procs: list[Any]) -> None:
    region, pa = _region(ns)
    try:
        with region.allocation_context():
            small = torch.zeros(4096, dtype=torch.int8)
            floats = torch.zeros(NBYTES, dtype=torch.float32)
            shaped = torch.zeros((NBYTES,), dtype=torch.int8)
            ones = torch.ones(NBYTES, dtype=torch.int8)
            kv = torch.zeros(NBYTES, dtype=torch.int8, device=torch.device("cpu"))
            second = torch.zeros(NBYTES, dtype=torch.int8)
        (name,) = arena.namespace_files(ns)
        assert name.startswith(f"omnikv_seg_{os.getpid()}_{arena.namespace_tag(ns)}_kv")
        st = os.stat(arena.path(name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == KV_OFFSET + NBYTES
        assert kv.dtype == torch.int8 and kv.shape == (NBYTES,) and not kv.any()
        for t, value in ((small, 0), (floats, 0), (shaped, 0), (ones, 1), (second, 0)):
            assert not kv.data_ptr() <= t.data_ptr() < kv.data_ptr() + NBYTES
            assert bool((t == value).all())
        assert floats.dtype == torch.float32
        # bytes written into the tensor are the file's bytes after the header
        kv.copy_(_pattern(1))
        with open(arena.path(name), "rb") as f:
            f.seek(KV_OFFSET)
            assert f.read() == _pattern(1).numpy().tobytes()
        per = NBYTES // 3
        views = [kv[i * per : (i + 1) * per].view(torch.bfloat16) for i in range(3)]
        got = region.export(views)
        assert got is not None
        desc, base, nbytes = got
        assert (base, nbytes) == (kv.data_ptr(), NBYTES)
        assert desc == {"kind": "shm", "name": name, "owner": pa.instance, "generation": 0}
        assert region.export([ones[:per].view(torch.bfloat16)]) is None
        # a consumer process maps the same bytes, and sees them change
        proc, conn = _start(procs, _consumer, ns, desc)
        assert _recv(conn) == _sha(_pattern(1))
        kv.copy_(_pattern(2))
        conn.send("again")
        assert _recv(conn) == _sha(_pattern(2))
        proc.join(30)
        assert proc.exitcode == 0
        _refused_descriptors(ns, desc)
    finally:
        region.close()
        pa.close()
    consumer, cpa = _region(ns)
    try:  # the producer closed: its cache is gone
        with pytest.raises(KVTransferError, match="gone"):
            consumer.attach(desc)
    finally:
        consumer.close()
        cpa.close()


def _refused_descriptors(ns: str, desc: dict[str, Any]) -> None:
    consumer, cpa = _region(ns)
    try:
        missing = {**desc, "name": f"{desc['name'][:-6]}zzzzzz"}
        with pytest.raises(KVTransferError, match="gone"):
            consumer.attach(missing)
        with pytest.raises(KVTransferError, match="another producer"):
            consumer.attach({**desc, "owner": desc["owner"] + 2})
        for bad in (
            {**desc, "name": "omnikv_seg_1/../../etc/passwd"},
            {**desc, "name": desc["name"].replace("omnikv_seg_", "omnikv_idx_")},
            {**desc, "name": None},
            {**desc, "kind": "cuda_ipc"},
            [desc],
        ):
            with pytest.raises(KVPayloadError):
                consumer.attach(bad)
        assert consumer.attach(desc).numel() == NBYTES  # the right one still maps
    finally:
        consumer.close()
        cpa.close()


# -- holds -------------------------------------------------------------------------------
def _waiting_in_flock(pid: int, hold: str, timeout: float = 60.0) -> None:
    """Return once process ``pid`` has the hold file open (it then blocks in flock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == arena.path(hold):
                    return
            except OSError:
                continue
        time.sleep(0.01)
    raise AssertionError("the reader never opened the hold file")


def test_holds_against_reader_processes(ns: str, procs: list[Any]) -> None:
    region, pa = _region(ns)
    consumer, cpa = _region(ns)
    try:
        with region.allocation_context():
            torch.zeros(NBYTES, dtype=torch.int8)
        hold = region.hold("p", "d", "k1")
        assert hold == region.hold_name("p", "d", "k1") == consumer.hold_name("p", "d", "k1")
        st = os.stat(arena.path(hold))
        assert stat.S_IMODE(st.st_mode) == 0o600
        with open(arena.path(hold), "rb") as f:
            assert f.read().decode() == region.owner_name
        assert arena.namespace_files(ns) == {hold, region.owner_name}
        assert not region.released(hold)
        with pytest.raises(KVTransferError, match="already exists"):
            region.hold("p", "d", "k1")
        assert region.hold("p", "e", "k1") != hold  # another edge, another hold
        region.release(region.hold_name("p", "e", "k1"))

        # a reader inside reading(): not released, cannot be taken back
        proc, conn = _start(procs, _reader, ns, hold, "wait")
        assert _recv(conn) == "inside"
        assert region.take_back(hold) is False
        assert not region.released(hold) and os.path.exists(arena.path(hold))
        conn.send("go")
        assert _recv(conn) == "done"
        proc.join(30)
        assert region.released(hold) and not os.path.exists(arena.path(hold))
        assert region.take_back(hold) is True

        # a reader SIGKILLed inside reading(): the kernel drops its lock
        hold2 = region.hold("p", "d", "k2")
        proc, conn = _start(procs, _reader, ns, hold2, "hang")
        assert _recv(conn) == "inside"
        assert region.take_back(hold2) is False
        proc.kill()
        proc.join(30)
        assert not region.released(hold2)  # it died before finishing: not released
        assert region.take_back(hold2) is True
        assert not os.path.exists(arena.path(hold2))

        # taken back before the reader came
        hold3 = region.hold("p", "d", "k3")
        assert region.take_back(hold3) is True
        with pytest.raises(KVTransferError, match="took back"):
            with consumer.reading(hold3):
                pytest.fail("read under a hold that was taken back")
    finally:
        consumer.close()
        cpa.close()
        region.close()
        pa.close()


def test_reader_blocked_while_the_hold_is_taken_back(ns: str, procs: list[Any]) -> None:
    """The producer's take_back steps by hand (lock, unlink, unlock) while a reader
    process waits for the lock: the reader must see the unlinked hold and refuse."""
    region, pa = _region(ns)
    try:
        hold = region.hold("p", "d", "k")
        fd = os.open(arena.path(hold), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            proc, conn = _start(procs, _reader, ns, hold, "wait")
            _waiting_in_flock(proc.pid, hold)
            assert not conn.poll(0.2)  # still waiting for the lock
            os.unlink(arena.path(hold))
        finally:
            os.close(fd)
        got = _recv(conn)
        assert got.startswith("error KVTransferError") and "as the copy began" in got, got
        proc.join(30)
        assert region.released(hold)
    finally:
        region.close()
        pa.close()


def test_release_reading_and_close(ns: str) -> None:
    region, pa = _region(ns)
    consumer, cpa = _region(ns)
    try:
        hold = region.hold("p", "d", "k")
        consumer.release(hold)
        consumer.release(hold)  # idempotent
        assert region.released(hold)
        for bogus in ("omnikv_hold_../x", "x", arena.path(hold)):
            consumer.release(bogus)  # nothing to release, nothing outside /dev/shm touched
        again = region.hold("p", "d", "k")  # the key is free again once released
        with pytest.raises(RuntimeError, match="copy failed"):
            with consumer.reading(again):
                raise RuntimeError("copy failed")
        assert region.released(again)  # a failed copy releases too
        for bad in (None, 3, "x", "omnikv_hold_a/b", "omnikv_seg_1_x"):
            with pytest.raises(KVPayloadError):
                with consumer.reading(bad):
                    pass
        kept = [region.hold("p", "d", f"open{i}") for i in range(3)]
        assert set(kept) <= arena.namespace_files(ns)
    finally:
        consumer.close()
        cpa.close()
        region.close()  # takes back every hold it made
        pa.close()
    assert not arena.namespace_files(ns)


# -- orphans -----------------------------------------------------------------------------
def test_sweep_removes_a_killed_producers_cache_and_holds(ns: str, procs: list[Any]) -> None:
    proc, conn = _start(procs, _doomed_producer, ns, 5)
    desc, holds = _recv(conn)
    files = arena.namespace_files(ns)
    assert files == {desc["name"], *holds}
    assert desc["name"].startswith(f"omnikv_seg_{proc.pid}_")
    consumer, cpa = _region(ns)
    try:
        assert _sha(consumer.attach(desc)) == _sha(_pattern(5).view(torch.uint8))
        removed = arena.sweep_orphans()
        assert not files & set(removed)  # its producer is alive
        assert arena.namespace_files(ns) == files
        proc.kill()
        proc.join(30)
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)
        with pytest.raises(KVTransferError, match="not alive"):
            consumer.attach(desc)  # the mapping it holds names a dead producer
        gc.collect()  # and it let that mapping go: the dead cache's memory can be freed
        with open("/proc/self/maps") as f:
            assert desc["name"] not in f.read()
        left = arena.namespace_files(ns)  # (another process on this host may sweep too)
        removed = arena.sweep_orphans()
        assert left <= set(removed)
        assert not arena.namespace_files(ns)
        with pytest.raises(KVTransferError, match="gone"):
            consumer.attach(desc)
    finally:
        consumer.close()
        cpa.close()


def _cache_producer(ns: str, seed: int, conn: Any) -> None:
    region, pa = _region(ns)
    with region.allocation_context():
        kv = torch.zeros(NBYTES, dtype=torch.int8)
    kv.copy_(_pattern(seed))
    conn.send({"kind": "shm", "name": region.owner_name, "owner": pa.instance})
    time.sleep(120)  # SIGKILLed long before


def _mapped(name: str) -> bool:
    gc.collect()
    with open("/proc/self/maps") as f:
        return name in f.read()


def test_restarted_producers_leave_no_mapping_and_maps_are_bounded(
    ns: str, procs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that restarts publishes a new cache; the consumer stops mapping the dead
    one's at its next new mapping (never read again, it would pin the dead cache's memory).
    Live producers' caches stay mapped up to ``MAX_MAPS``, least recently used out first."""
    from vllm_omni_kv.backends.shm import cache_region

    monkeypatch.setattr(cache_region, "MAX_MAPS", 2)
    consumer, cpa = _region(ns)
    try:
        proc, conn = _start(procs, _cache_producer, ns, 1)
        old = _recv(conn)
        assert _sha(consumer.attach(old)) == _sha(_pattern(1).view(torch.uint8))
        proc.kill()
        proc.join(30)
        live = [_recv(_start(procs, _cache_producer, ns, seed)[1]) for seed in (2, 3, 4)]
        assert _sha(consumer.attach(live[0])) == _sha(_pattern(2).view(torch.uint8))
        assert not _mapped(old["name"]), "a dead producer's cache stays mapped"
        consumer.attach(live[1])
        consumer.attach(live[0])  # used again: live[1] is now the least recently used
        consumer.attach(live[2])
        assert [_mapped(d["name"]) for d in live] == [True, False, True]
        assert _sha(consumer.attach(live[1])) == _sha(_pattern(3).view(torch.uint8))
    finally:
        consumer.close()
        cpa.close()
        for p in procs:
            p.kill()
            p.join(30)
        arena.sweep_orphans()


# -- placement: vLLM's allocate_kv_cache, which its model runner runs in get_mem_pool_context
@pytest.fixture
def region(ns: str) -> Iterator[ShmCacheRegion]:
    r, pa = _region(ns)
    yield r
    r.close()
    pa.close()


def _vllm_cache(layout: str, *, empty: bool = False) -> list[torch.Tensor]:
    """3 MiB of bf16 layers by vLLM; ``empty``: its views over ``torch.empty`` (a new allocator)."""
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    lay, blocks, page, names = KVCacheLayout[layout], 128, spec.page_size_bytes, ["a", "b", "c"]
    fixed = (None, page * 3 if lay.is_block_outermost else None, None, None, None)
    strides = kvi.compute_layout_strides(spec, blocks, 3, lay, fixed_strides=fixed)
    tensor = kvi.KVCacheTensor(page * blocks * 3, names, strides[0], strides[1])
    if empty:
        raw = torch.empty(tensor.size, dtype=torch.int8)
        return kvi.create_kv_cache_views(raw, spec, blocks, lay, tensor)
    cfg = kvi.KVCacheConfig(blocks, [tensor], [kvi.KVCacheGroupSpec(names, spec)])
    return list(allocate_kv_cache(cfg, torch.device("cpu"), lay).values())


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])  # layer- and block-outermost
def test_vllm_allocates_in_the_segment(ns: str, region: ShmCacheRegion, layout: str) -> None:
    with region.allocation_context():
        caches = _vllm_cache(layout)
    region.check_placement(caches)
    (name,), got = arena.namespace_files(ns), region.export(caches)
    assert got is not None and got[2] == 3 << 20 and region.tensor is not None
    assert region.unavailable_reason is None
    for i, c in enumerate(caches):
        c.view(torch.int16).copy_(_pattern(10 + i, c.numel() * 2).view(torch.int16).view(c.shape))
    raw = torch.from_numpy(np.fromfile(arena.path(name), dtype="<i2", offset=KV_OFFSET))  # file
    for c in caches:
        off = (c.data_ptr() - got[1]) // 2
        assert torch.equal(raw.as_strided(c.shape, c.stride(), off), c.view(torch.int16))
    stray = torch.zeros(1 << 20, dtype=torch.int8).view(torch.bfloat16)
    with pytest.raises(ConfigError, match=f"outside .*{name}.*layer 3 spans.*share_cache: f"):
        region.check_placement([*caches, stray])
    beyond = np.lib.stride_tricks.as_strided(region.tensor.numpy()[-64:], (2, 64), (4096, 1))
    with pytest.raises(ConfigError, match="layer 1 spans"):  # row 2 is past the end (unread)
        region.check_placement([caches[0], torch.from_numpy(beyond)])
    with pytest.raises(ConfigError, match="layer 0 is on meta"):
        region.check_placement([torch.empty(4, device="meta"), *caches])


def test_an_allocation_elsewhere_fails_the_check(ns: str, region: ShmCacheRegion) -> None:
    caches = _vllm_cache("LBNHC")  # get_mem_pool_context not used
    with pytest.raises(ConfigError, match="never entered.*share_cache: false"):
        region.check_placement(caches)
    with region.allocation_context():
        caches = _vllm_cache("LBNHC", empty=True)
    with pytest.raises(ConfigError, match="allocated nothing through it.*share_cache: false"):
        region.check_placement(caches)
    assert region.export(caches) is None and not arena.namespace_files(ns)


@pytest.fixture(params=["small", "absent"])
def no_room(request: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The arena's directory: a 2 MiB tmpfs (needs root to mount; skipped otherwise), or none."""
    mnt = str(tmp_path / "shm")
    monkeypatch.setattr(arena, "SHM_DIR", mnt)
    if request.param == "absent":
        yield f"cannot create {re.escape(mnt)}/omnikv_seg_.*No such file"
        return
    os.mkdir(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mnt], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    yield f"{re.escape(mnt)} has no room for the 3.0 MiB KV cache .*--shm-size"
    assert os.listdir(mnt) == []
    subprocess.run(["umount", "-l", mnt], check=False)


def test_no_room_leaves_the_cache_to_vllm(region: ShmCacheRegion, no_room: str) -> None:
    with region.allocation_context():
        caches = _vllm_cache("LBNHC")
    assert re.search(no_room, region.unavailable_reason or ""), region.unavailable_reason
    assert region.tensor is None and all(not c.any() for c in caches)  # vLLM's own
    with pytest.raises(ConfigError, match=no_room):
        region.check_placement(caches)
    assert region.export(caches) is None


def test_view_extent_matches_every_element_address() -> None:
    base = torch.zeros(4096, dtype=torch.int8)
    for v in (  # against the address of every element, one by one
        base[16:400].view(torch.int32).view(4, 24).t(),  # transposed
        base.as_strided((3, 5, 2), (700, 3, 1000), 7),  # strides out of order, gaps
        base.as_strided((6, 4), (0, 9), 100),  # a broadcast (zero) stride
        base[100:300].view(torch.bfloat16).view(10, 10)[2:7:2, 1::3],  # a slice of a slice
    ):
        addrs = [v[i].data_ptr() for i in np.ndindex(*v.shape)]
        assert view_extent(v) == (min(addrs), max(addrs) + v.element_size())
