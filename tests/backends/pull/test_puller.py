"""The pull connector's bounded reads (:class:`~vllm_omni_kv.backends.pull.puller.Puller`):
a read that fails is reported at once with its own error, one still running past the
timeout is abandoned, and either way its destination is given back only once the read
has ended.

The engines here are stand-ins for faults a real transport cannot be made to show on
demand: a read that raises a ``TimeoutError`` of its own (a socket timeout escaping an
engine), and a read that blocks until released.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Iterator

import pytest

from vllm_omni_kv.backends.pull.puller import Puller, PullFailed, when_reads_end
from vllm_omni_kv.errors import KVTransferCancelled, KVTransferTimeout


class _TimingOutEngine:
    """Every read raises a ``TimeoutError`` (``concurrent.futures``' "not done yet")."""

    session = "127.0.0.1:1"

    def read(self, session: str, local: int, remote: int, length: int) -> None:
        raise TimeoutError("socket read timed out inside the engine")


class _BlockedEngine:
    """Every read blocks until ``go`` is set."""

    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.go = threading.Event()

    def read(self, session: str, local: int, remote: int, length: int) -> None:
        self.go.wait(30)


@pytest.fixture
def pool() -> Iterator[cf.ThreadPoolExecutor]:
    with cf.ThreadPoolExecutor(2, thread_name_prefix="pytest-pull") as ex:
        yield ex


def test_a_read_that_raises_timeout_error_fails_at_once_with_its_error(
    pool: cf.ThreadPoolExecutor,
) -> None:
    """A ``TimeoutError`` raised by the read itself is its failure, not "still running":
    the pull fails well before its 10 s timeout, naming the engine's error, and its read
    has ended (the destination can be given back at once)."""
    puller = Puller(_TimingOutEngine(), pool, timeout_s=10.0)  # type: ignore[arg-type]
    track: list[cf.Future[None]] = []
    t0 = time.monotonic()
    with pytest.raises(PullFailed, match="socket read timed out inside the engine"):
        puller.read("s", 0, 0, 64, time.monotonic() + 10, threading.Event(), what="k", track=track)
    assert time.monotonic() - t0 < 5.0, "the failed read was waited on until its timeout"
    assert [f.done() for f in track] == [True]


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_an_abandoned_read_keeps_its_destination_until_it_ends(
    pool: cf.ThreadPoolExecutor, how: str
) -> None:
    """Past the timeout the pull raises ``KVTransferTimeout``, on its cancel event
    ``KVTransferCancelled``; either way the destination (freed by :func:`when_reads_end`
    on the tracked read) is given back only once the engine's read has returned."""
    engine = _BlockedEngine()
    puller = Puller(engine, pool, timeout_s=0.3 if how == "timeout" else 30)  # type: ignore[arg-type]
    cancel = threading.Event()
    if how == "cancel":
        threading.Timer(0.2, cancel.set).start()
    track: list[cf.Future[None]] = []
    err = KVTransferTimeout if how == "timeout" else KVTransferCancelled
    with pytest.raises(err):
        puller.read("s", 0, 0, 64, time.monotonic() + 10, cancel, what="k", track=track)
    freed = threading.Event()
    when_reads_end(track, freed.set)
    assert not freed.wait(0.5), "the destination was freed while the read still ran"
    assert [f.done() for f in track] == [False]
    engine.go.set()
    assert freed.wait(10), "the destination was not freed once the read ended"


class _HostOnlyEngine:
    """An engine adapter with no ``register_device`` (host memory only)."""

    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []

    def register(self, addr: int, size: int) -> None:
        self.registered.append((addr, size))


def test_device_memory_is_registered_only_with_an_engine_that_moves_it() -> None:
    """A pool or cache in GPU memory is refused at registration by an engine that cannot
    move device memory (a host-only adapter; Mooncake's non-CUDA build, which would take
    the address for host memory), not at its first read."""
    import torch

    from vllm_omni_kv.backends.pull.puller import register_memory
    from vllm_omni_kv.errors import KVTransferError

    host = _HostOnlyEngine()
    register_memory(host, "host-only", 4096, 8192, torch.device("cpu"))  # type: ignore[arg-type]
    assert host.registered == [(4096, 8192)]
    with pytest.raises(KVTransferError, match="cannot move cuda:0 memory"):
        register_memory(host, "host-only", 4096, 8192, torch.device("cuda", 0))  # type: ignore[arg-type]
    assert host.registered == [(4096, 8192)]
    pytest.importorskip("mooncake.engine")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeEngine, cuda_build

    if cuda_build():
        pytest.skip("the CUDA build of Mooncake moves device memory")
    engine = MooncakeEngine("127.0.0.1", protocol="tcp")
    try:
        with pytest.raises(KVTransferError, match="CUDA build"):
            register_memory(engine, "mooncake_te", 4096, 8192, torch.device("cuda", 0))
    finally:
        engine.close()
