"""Pull connectors with device memory (issue 24, items 2 and 5): a put into a device pool
exposes its block only once the block holds the bytes, and every engine read runs on a
pull thread bound to the device it touches.

The ordering is checked on the host with recording streams (the stream paths then run
on host tensors); the ``gpu`` tests check the same on a CUDA device (``make gpu-check``).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
import time
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.pool import MemoryPool
from vllm_omni_kv.backends.pull.pull_stream import Lease, RawPullStream
from vllm_omni_kv.backends.pull.puller import Puller
from vllm_omni_kv.backends.pull.staging import stage_in_pool
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.prelude import CHECKSUM_LINEAR

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _payload(device: str, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randint(-100, 100, (64, 1024), generator=g, dtype=torch.int32).to(device),
        "name": "r",
    }


@pytest.mark.parametrize("kind", ["frame", "tensor", "bytes"])
def test_a_put_into_a_device_pool_returns_once_its_copies_ran(kind: str) -> None:
    """Whatever is queued on the putting thread's stream when the put copies into the
    block (the packed frame, the copy into the block) has run before the put returns:
    the block's address goes to consumers then."""
    fake = RecordingStreams()
    data = _payload("cpu")
    obj: Any = {"frame": codec.encode(data), "tensor": data["k"], "bytes": b"x" * 70_000}[kind]
    with device_order.installed("cpu", fake):
        pool = MemoryPool(4 << 20, "cpu")
        queued = fake.work(fake.forward, "the frame packed on the device")
        buf, size, _fast, _dtype, _shape = stage_in_pool(pool, obj)
    try:
        assert fake.waited_for(queued), "the block was exposed before its bytes landed"
        if kind == "frame":  # packed by the device path: linear digests, checked here
            raw = buf.tensor[:size].numpy()
            assert codec.read_prelude(raw, size).alg == CHECKSUM_LINEAR
            got = codec.decode(raw)
            assert torch.equal(got["k"], data["k"]) and got["name"] == "r"
        elif kind == "tensor":
            assert torch.equal(buf.tensor[:size].view(torch.int32).view(64, 1024), data["k"])
        else:
            assert bytes(buf.tensor[:size].numpy()) == obj
    finally:
        buf.release()


class _Engine:
    """An engine whose reads are memmoves; it notes the thread and the device bound in it
    at the time of each read."""

    session = "127.0.0.1:1"

    def __init__(self, fake: RecordingStreams | None = None) -> None:
        self.fake = fake
        self.reads: list[tuple[str, Any]] = []

    def _note(self) -> None:
        name = threading.current_thread().name
        if self.fake is not None:
            bound = [d for t, d in self.fake.devices if t == name]
            self.reads.append((name, bound[-1] if bound else None))
        else:
            self.reads.append((name, _cuda_context_current()))

    def read(self, session: str, local: int, remote: int, length: int) -> None:
        self._note()
        ctypes.memmove(local, remote, length)

    def register(self, addr: int, size: int) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def close(self) -> None: ...


def test_pull_threads_bind_the_device_before_each_read() -> None:
    """Engines move device memory with the calling thread's device and context: every
    read (single and batched) runs on a pull thread bound to the puller's device."""
    fake = RecordingStreams()
    engine = _Engine(fake)
    src, dst = torch.arange(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    with cf.ThreadPoolExecutor(2, thread_name_prefix="pytest-pull") as pool:
        puller = Puller(engine, pool, timeout_s=10.0)
        puller.device = torch.device("cpu")
        with device_order.installed("cpu", fake):
            deadline = time.monotonic() + 10
            puller.read("s", dst.data_ptr(), src.data_ptr(), 1024, deadline, None, what="one")
            reads = [(dst.data_ptr() + o, src.data_ptr() + o, 1024) for o in (1024, 2048, 3072)]
            puller.read_many("s", reads, deadline, what="batch")
    assert torch.equal(dst, src)
    assert len(engine.reads) == 4
    for thread, bound in engine.reads:
        assert thread.startswith("pytest-pull")
        assert bound == torch.device("cpu"), f"{thread} read with no device bound"


def _pull_frame(src: torch.Tensor, require_digests: bool) -> Any:
    """What a device-pool receiver makes of the frame ``src`` (pulled whole, then decoded)."""
    pool = MemoryPool(1 << 20, "cpu")
    with cf.ThreadPoolExecutor(1, thread_name_prefix="pytest-pull") as ex:
        puller = Puller(_Engine(RecordingStreams()), ex, 10.0, require_digests=require_digests)
        local = pool.alloc(src.numel())
        lease = Lease(lambda ok: True)
        size = src.numel()
        with RawPullStream(
            puller, "s", src.data_ptr(), size, local, lease, what="k", frame=True
        ) as s:
            for _ in s.load(None, time.monotonic() + 10):
                pass
            return s.obj


def test_a_device_pool_receiver_checks_digests_and_requires_them() -> None:
    """A frame pulled whole into a device pool is decoded with its digests checked: a flipped
    byte is refused, and a frame without digests too unless ``require_digests`` is off."""
    data = _payload("cpu", seed=5)
    frame = codec.encode(data, 4096)
    linear = frame.to_device_tensor("cpu", on_device=True)
    assert torch.equal(_pull_frame(linear, True)["k"], data["k"])
    bad = linear.clone()
    bad[frame.data_start + 5000] ^= 1
    with pytest.raises(KVPayloadError, match=r"chunk 1 \(.*checksum mismatch"):
        _pull_frame(bad, True)
    plain = torch.zeros(frame.plain_nbytes, dtype=torch.uint8)
    frame.pack_into(plain.numpy(), checksum=False)
    with pytest.raises(KVPayloadError, match="no checksum.*require_digests"):
        _pull_frame(plain, True)
    assert torch.equal(_pull_frame(plain, False)["k"], data["k"])


# -- on a CUDA device ------------------------------------------------------------------------
def _cuda_context_current() -> bool:
    """Whether the calling thread has a current CUDA context (driver API)."""
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    return lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["frame", "tensor"])
def test_cuda_pool_block_is_final_when_put_returns(kind: str) -> None:
    """A put into a CUDA pool while the forward stream is busy: read at once on a stream
    that waits for nothing, the block already holds the put's bytes."""
    data = _payload("cuda", seed=3)
    want = data["k"].cpu()
    pool = MemoryPool(16 << 20, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the forward still running
    obj: Any = codec.encode(data) if kind == "frame" else data["k"]
    buf, size, _fast, _dtype, _shape = stage_in_pool(pool, obj)
    try:
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            host = buf.tensor[:size].to("cpu")
        if kind == "frame":  # its linear digests checked on the host, then on the device
            got = codec.decode_tensor(host)["k"]
            assert torch.equal(codec.decode_tensor(buf.tensor[:size].clone())["k"].cpu(), want)
        else:
            got = host.view(torch.int32).view(want.shape)
        assert torch.equal(got.cpu(), want), "the block was exposed before its copy ran"
    finally:
        torch.cuda.synchronize()
        buf.release()


@pytest.mark.gpu
@needs_cuda
def test_cuda_pull_threads_have_the_device_and_a_context_current() -> None:
    """A pull thread that never touched CUDA: its read runs with the puller's device
    current and its context bound (what UCX's CUDA transports and Mooncake need)."""
    engine = _Engine()
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    src = torch.arange(4096, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    seen: list[int] = []

    def read(session: str, local: int, remote: int, length: int) -> None:
        _Engine.read(engine, session, local, remote, length)  # notes the context first
        seen.append(torch.cuda.current_device())

    engine.read = read  # type: ignore[method-assign]
    with cf.ThreadPoolExecutor(1, thread_name_prefix="pytest-pull") as pool:
        puller = Puller(engine, pool, timeout_s=10.0)
        puller.device = device
        puller.read(
            "s", dst.data_ptr(), src.data_ptr(), 4096, time.monotonic() + 10, None, what="x"
        )
    assert torch.equal(dst, src)
    assert engine.reads and engine.reads[0][1], "the pull thread had no CUDA context current"
    assert seen == [device.index]
