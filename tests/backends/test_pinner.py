"""Registration with CUDA off the request path (issue 30, item 5): ``backends/pinner.py``,
``backends/shm/pinned_map.py``, ``backends/host_pin.py``.

Without a GPU, the CUDA calls are recorded (``vllm_omni_kv.testing.pin_ops``): the recorder
refuses overlapping registrations with 712 and unknown unregistrations with 713 as the
driver does, and notes whether the kernel had the range mapped (``/proc/self/maps``) at each
call. The ``gpu`` test repeats the copy check with real registrations.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import pytest
import torch

from vllm_omni_kv.backends import host_pin
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.host_pin import CudaPinOps, failure_message, register
from vllm_omni_kv.backends.pinner import Pinner, install_pinner
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.pinned_map import PinnedMap
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.testing.pin_ops import RecordingPinOps

MIB = 1 << 20


#: the ``ns`` fixture (tests/backends/conftest.py) lets files be left: they are planted
NS_MAY_LEAVE_FILES = True


@contextlib.contextmanager
def _install(ops: RecordingPinOps) -> Iterator[Pinner]:
    """This process's pinner over ``ops`` for the block."""
    pinner = Pinner(ops)
    old = install_pinner(pinner)
    try:
        yield pinner
    finally:
        install_pinner(old)


@pytest.fixture
def gate() -> threading.Event:
    return threading.Event()


@pytest.fixture
def gated(gate: threading.Event) -> Iterator[tuple[RecordingPinOps, Pinner]]:
    """This process's pinner over recording ops whose registrations wait for ``gate``."""
    ops = RecordingPinOps(gate=gate)
    with _install(ops) as pinner:
        try:
            yield ops, pinner
        finally:
            gate.set()  # never leave the pinner's thread waiting


def test_put_never_registers_and_copies_before_the_registration_lands_are_exact(
    ns: str, gate: threading.Event, gated: tuple[RecordingPinOps, Pinner]
) -> None:
    """A producer's new pooled segment and a consumer's mapping of it are registered by
    the pinner's thread: ``put`` and ``get`` return while registration is held back, with
    the payload's exact bytes; once registration lands, the next round trip is exact too."""
    ops, pinner = gated
    spec = ConnectorSpec("shm", {"namespace": ns, "pool_max_bytes": 8 * MIB})
    prod = OmniConnectorFactory.create_connector(spec)
    cons = OmniConnectorFactory.create_connector(spec)
    gen = torch.Generator().manual_seed(30)
    try:
        sent = torch.randint(-(2**31), 2**31 - 1, (MIB // 4,), dtype=torch.int32, generator=gen)
        prod.put("p", "d", "k0", {"t": sent})
        got = cons.get("p", "d", "k0")
        assert got is not None and torch.equal(got[0]["t"], sent)
        del got
        assert ops.calls == [], "a registration ran before the gate opened"
        gate.set()
        assert pinner.wait_idle(30)
        registered = ops.of("register")
        assert len(registered) == 2  # the producer's segment, the consumer's mapping of it
        assert all(c.code == 0 and c.mapped for c in registered)
        assert threading.get_ident() not in {c.thread for c in registered}
        again = torch.flip(sent, (0,))
        prod.put("p", "d", "k1", {"t": again})
        got = cons.get("p", "d", "k1")
        assert got is not None and torch.equal(got[0]["t"], again)
        del got
        assert pinner.wait_idle(30) and len(ops.of("register")) == 2  # reused: pinned once
    finally:
        cons.close()
        prod.close()
    assert pinner.wait_idle(30)
    assert sorted(c.ptr for c in ops.of("unregister")) == sorted(c.ptr for c in registered)
    assert all(c.code == 0 and c.mapped for c in ops.calls)


def test_a_pin_goes_before_its_mapping_at_reused_addresses() -> None:
    """Mappings created and destroyed at the same addresses, closed or dropped to the
    garbage collector, after or before their registration landed: every unregistration
    finds the range still mapped, and no registration meets a stale one (712)."""
    ops = RecordingPinOps()
    with _install(ops) as pinner:
        starts = []
        for i in range(24):
            mm = PinnedMap(-1, 2 * MIB)
            starts.append(mm.address())
            mm.pin_later()
            if i % 3:
                assert mm.pin is not None and mm.pin.wait(30) and mm.pin.pinned
            if i % 2:
                mm.close()
            else:
                del mm  # the collector: PinnedMap unregisters before mmap unmaps
        assert pinner.wait_idle(30)
    assert len(set(starts)) < len(starts), "no address was reused: the check proves nothing"
    regs, unregs = ops.of("register"), ops.of("unregister")
    assert all(c.code == 0 for c in ops.calls), [c for c in ops.calls if c.code]
    assert all(c.mapped for c in ops.calls), "a range was (un)registered while not mapped"
    assert sorted(c.ptr for c in regs) == sorted(c.ptr for c in unregs) and not ops.registered


def test_a_registration_in_flight_is_undone_before_its_memory_goes(
    gate: threading.Event, gated: tuple[RecordingPinOps, Pinner]
) -> None:
    """``close`` during the registration returns at once and leaves the unmap to the
    pinner's thread, after the unregistration; ``unpin`` (the collector's path) waits for
    it; a queued registration is cancelled."""
    ops, pinner = gated
    first, second, third = (PinnedMap(-1, MIB) for _ in range(3))
    first.pin_later()  # the pinner's thread takes it and waits at the gate
    assert ops.entered.wait(30)
    second.pin_later()  # queued behind it
    third.pin_later()
    at_first, at_third = first.address(), third.address()
    second.close()  # cancelled: never registered
    first.close()  # returns at once: its registration is in flight
    assert not first.closed, "unmapped under a registration in flight"
    waiter = threading.Thread(target=third.unpin)  # third is queued: the gate holds first
    waiter.start()
    waiter.join(5)
    assert not waiter.is_alive(), "a queued registration was waited for"
    gate.set()
    assert pinner.wait_idle(30)
    assert first.closed and second.closed and not third.closed
    assert [(c.op, c.ptr, c.mapped, c.code) for c in ops.calls] == [
        ("register", at_first, True, 0),
        ("unregister", at_first, True, 0),
    ], "third was registered after its release, or first unmapped before its unregistration"
    assert at_third not in {c.ptr for c in ops.calls}
    third.close()


def test_unpin_waits_for_a_registration_in_flight(
    gate: threading.Event, gated: tuple[RecordingPinOps, Pinner]
) -> None:
    ops, pinner = gated
    mm = PinnedMap(-1, MIB)
    mm.pin_later()
    assert ops.entered.wait(30)
    waiter = threading.Thread(target=mm.unpin)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "unpin returned while the registration was in flight"
    gate.set()
    waiter.join(30)
    assert pinner.wait_idle(30) and [c.op for c in ops.calls] == ["register", "unregister"]
    assert all(c.mapped and c.code == 0 for c in ops.calls)
    mm.close()


def test_failure_messages_name_the_cuda_error_and_advise_memlock_only_on_allocation() -> None:
    """Names from the CUDA runtime API's ``cudaError`` enum."""
    alloc = failure_message("cudaHostRegister", 2, MIB)
    assert "CUDA error 2 cudaErrorMemoryAllocation" in alloc and "ulimit -l" in alloc
    twice = failure_message("cudaHostRegister", 712, MIB)
    assert "CUDA error 712 cudaErrorHostMemoryAlreadyRegistered" in twice
    unsupported = failure_message("cudaHostRegister", 801, MIB)
    assert "CUDA error 801 cudaErrorNotSupported" in unsupported
    gone = failure_message("cudaHostUnregister", 713, MIB)
    assert "CUDA error 713 cudaErrorHostMemoryNotRegistered" in gone
    for text in (twice, unsupported, gone):
        assert "ulimit" not in text and "memlock" not in text


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_each_distinct_failure_is_logged_and_our_own_double_registration_is_pinned() -> None:
    """Errors 2 and 801 are used by no other test (each is logged once per process)."""
    lines = _Lines()
    log = logging.getLogger(host_pin.__name__)
    log.addHandler(lines)
    buf = bytearray(MIB)
    ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    try:
        refusing = RecordingPinOps(fail=2)
        assert register(ptr, MIB, refusing) is None
        assert register(ptr, MIB, refusing) is None  # the same error again: logged once
        assert len(lines.lines) == 1 and "cudaErrorMemoryAllocation" in lines.lines[0]
        assert register(ptr, MIB, RecordingPinOps(fail=801)) is None
        assert len(lines.lines) == 2, "a later, different error was hidden"
        assert "801 cudaErrorNotSupported" in lines.lines[1] and "ulimit" not in lines.lines[1]
        ops = RecordingPinOps()
        ops.registered[ptr] = MIB  # registered by other code in this process: refused (712)
        assert register(ptr, MIB, ops) is None and ops.of("register")[0].code == 712
        del ops.registered[ptr]
        logged = len(lines.lines)
        pin = register(ptr, MIB, ops)
        again = register(ptr + 4096, 8192, ops)  # inside our own registration: pinned
        assert pin is not None and pin.owned and again is not None and not again.owned
        assert len(ops.of("register")) == 2 and len(lines.lines) == logged  # no call, no log
        again.release()
        assert ops.registered == {ptr: MIB}  # still registered by ``pin``
        pin.release()
        assert ops.registered == {} and [c.code for c in ops.of("unregister")] == [0]
    finally:
        log.removeHandler(lines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_are_exact_before_and_after_the_registration_lands(
    gate: threading.Event,
) -> None:
    torch.zeros(1, device="cuda")  # CUDA in use, as in a GPU worker
    ops = RecordingPinOps(inner=CudaPinOps(), gate=gate)
    with _install(ops) as pinner:
        try:
            mm = PinnedMap(-1, 16 * MIB)
            host = torch.frombuffer(arena.exported(mm), dtype=torch.uint8)
            host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
            mm.pin_later()
            assert not host.is_pinned()  # held at the gate
            dev = torch.empty_like(host, device="cuda")
            dev.copy_(host, non_blocking=True)  # pageable: synchronous, exact
            assert torch.equal(dev.cpu(), host)
            gate.set()
            assert mm.pin is not None and mm.pin.wait(30) and mm.pin.pinned
            assert host.is_pinned()
            back = torch.empty_like(host)
            dev.add_(1)
            torch.frombuffer(arena.exported(mm), dtype=torch.uint8).copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            back.copy_(host)
            assert torch.equal(back, (dev.cpu()))
            del host, back
            mm.unpin()
            arena.close_map(mm)
        finally:
            gate.set()
        assert pinner.wait_idle(30)
    assert all(c.code == 0 and c.mapped for c in ops.calls)
