"""Which shared-memory mappings are registered with CUDA, and when they are unregistered
(issue 24, item 7).

Registering (``cudaHostRegister``) costs about 0.6 s per GiB, so only pooled segments
(mapped for the process's life) are registered, once, in the background; a one-shot
segment (read once, then unlinked) is not, on either side. A consumer's mapping evicted or
dropped while a load thread still copies out of it is unregistered and unmapped only once
that load is done.

On the host, registration is observed through this process's pinner over recording
``PinOps`` (``vllm_omni_kv.testing.pin_ops``: CUDA "in use", calls recorded with whether the
kernel had the range mapped); the ``gpu`` tests check real registrations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends import pinner as pinner_module
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.pinner import Pinner, install_pinner
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.consumer_maps import ConsumerMaps
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.testing.pin_ops import RecordingPinOps


@pytest.fixture
def ops() -> Iterator[RecordingPinOps]:
    """Registrations as a CUDA process would make them, recorded (this process's pinner)."""
    rec = RecordingPinOps()
    old = install_pinner(Pinner(rec))
    yield rec
    install_pinner(old)


def _log(rec: RecordingPinOps) -> list[tuple[str, int]]:
    """The registrations and unregistrations so far, by address (background ones landed)."""
    pinner = pinner_module.default_pinner()
    assert pinner.wait_idle(30)
    assert all(c.code == 0 and c.mapped for c in rec.calls), rec.calls
    return [(c.op, c.ptr) for c in rec.calls]


#: the ``ns`` fixture (tests/backends/conftest.py) lets files be left: they are planted
NS_MAY_LEAVE_FILES = True


def _address(mm: Any) -> int:
    return torch.frombuffer(arena.exported(mm), dtype=torch.uint8).data_ptr()


def test_pooled_segments_are_registered_once_and_one_shots_never(
    ns: str, ops: RecordingPinOps
) -> None:
    pa = ProducerArena(2 << 20, namespace=ns)
    try:
        seg, pooled = pa.acquire(1 << 20)
        assert pooled and _log(ops) == [("register", _address(seg.mm))]
        pa.release_unpublished(seg, pooled)
        again, pooled = pa.acquire(1 << 20)  # reused: registered already
        assert again is seg and pooled and len(_log(ops)) == 1
        shot, pooled = pa.acquire(3 << 20)  # beyond the pool: a one-shot segment
        assert not pooled
        assert len(_log(ops)) == 1, "a one-shot segment was registered"
        pa.release_unpublished(shot, pooled)
        pa.release_unpublished(again, True)
    finally:
        pa.close()
    log = _log(ops)  # unregistered while still mapped (checked in _log)
    assert log[-1] == ("unregister", log[0][1])


def test_a_consumer_registers_pooled_segments_once_and_one_shots_never(
    ns: str, ops: RecordingPinOps
) -> None:
    """Through the shm backend: a payload in a pooled segment read twice (one registration
    on each side), one in a one-shot segment (none)."""
    spec = ConnectorSpec("shm", {"namespace": ns, "pool_max_bytes": 4 << 20})
    prod = OmniConnectorFactory.create_connector(spec)
    cons = OmniConnectorFactory.create_connector(spec)
    try:
        small, big = torch.ones(1 << 18), torch.ones(3 << 18)  # 1 MiB, 3 MiB
        for i, t in enumerate((small, small, big)):
            prod.put("p", "d", f"k{i}", {"t": t})
            got = cons.get("p", "d", f"k{i}")
            assert got is not None and torch.equal(got[0]["t"], t)
            del got
        registered = [p for kind, p in _log(ops) if kind == "register"]
        assert len(registered) == 2, f"{len(registered)} registrations for one pooled segment"
    finally:
        cons.close()
        prod.close()


def test_a_mapping_in_use_is_unregistered_only_once_its_reader_is_done(
    ns: str, ops: RecordingPinOps
) -> None:
    pa = ProducerArena(64 << 20, namespace=ns)
    maps = ConsumerMaps(max_maps=1)
    try:
        segs = [pa.acquire(1 << 20)[0] for _ in range(3)]
        skip = len(_log(ops))  # the producer's own registrations
        a = maps.acquire(segs[0].name)
        a_at = _address(a)
        b = maps.acquire(segs[1].name)  # evicts a (one mapping cached) while a is read
        assert ("unregister", a_at) not in _log(ops) and not a.closed
        assert maps.in_use() == 2
        maps.release(a)  # its reader is done: now it goes
        assert ("unregister", _address(b)) not in _log(ops)
        assert a.closed and _log(ops)[-1] == ("unregister", a_at)
        c = maps.acquire(segs[2].name, pin=False)  # a one-shot segment: not registered
        assert len([p for k, p in _log(ops)[skip:] if k == "register"]) == 2
        assert not b.closed  # evicted by c while in use: stays
        maps.release(b)
        assert b.closed
        maps.release(c)
        assert not c.closed  # cached until dropped
        maps.drop(segs[2].name)  # unlinked by its reader
        assert c.closed
    finally:
        maps.close()
        pa.close()
    log = _log(ops)
    assert sorted(p for k, p in log if k == "register") == sorted(
        p for k, p in log if k == "unregister"
    ), "a registration outlived its mapping"


# -- on a CUDA device ------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_one_shot_segments_are_not_pinned_and_pooled_ones_are_once(ns: str) -> None:
    """Real registrations: a pooled segment's memory is pinned (and reused without
    registering again), a one-shot segment's is not."""
    torch.zeros(1, device="cuda")  # CUDA in use, as in a GPU worker
    pa = ProducerArena(8 << 20, namespace=ns)
    try:
        seg, pooled = pa.acquire(4 << 20)
        assert pooled and seg.mm.pin is not None and seg.mm.pin.wait(30) and seg.mm.pin.pinned
        assert torch.frombuffer(arena.exported(seg.mm), dtype=torch.uint8).is_pinned()
        pa.release_unpublished(seg, pooled)
        again, pooled = pa.acquire(4 << 20)
        assert again is seg and again.mm.pin is seg.mm.pin
        shot, pooled = pa.acquire(12 << 20)
        assert not pooled and shot.mm.pin is None
        assert not torch.frombuffer(arena.exported(shot.mm), dtype=torch.uint8).is_pinned()
        pa.release_unpublished(shot, pooled)
        pa.release_unpublished(again, True)
    finally:
        pa.close()
    assert seg.mm.pin is None  # released with its mapping


@pytest.mark.gpu
@needs_cuda
def test_cuda_a_mapping_stays_pinned_while_a_copy_reads_it(ns: str) -> None:
    """A consumer mapping evicted while a load copies out of it by DMA stays registered
    until the load is done; the copy's bytes are the segment's."""
    torch.zeros(1, device="cuda")
    pa = ProducerArena(16 << 20, namespace=ns)
    maps = ConsumerMaps(max_maps=1)
    try:
        a_seg, b_seg = pa.acquire(4 << 20)[0], pa.acquire(4 << 20)[0]
        src = torch.frombuffer(arena.exported(a_seg.mm), dtype=torch.uint8)
        src.copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8))
        a = maps.acquire(a_seg.name)
        assert a.pin is not None and a.pin.wait(30) and a.pin.pinned
        view = torch.frombuffer(arena.exported(a), dtype=torch.uint8)
        dst = torch.empty(view.shape, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(100_000_000)
        dst.copy_(view, non_blocking=True)  # queued behind the sleep, reading the mapping
        maps.acquire(b_seg.name)  # evicts a while the copy is queued
        assert view.is_pinned(), "the mapping was unregistered under a queued copy"
        torch.cuda.synchronize()
        maps.release(a)
        assert torch.equal(dst.cpu(), src)
    finally:
        maps.close()
        pa.close()
