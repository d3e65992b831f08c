"""Producer staging (one device buffer for every layer's pages) on vLLM's layouts.

Caches are built the way vLLM 0.32 builds them (the layout emulator), tokens are
stored the way the kernels address them, and the staged payload is packed, sent
through the wire format and injected into a consumer cache whose tokens are read
back the kernels' way. Runs on ``OMNIKV_TEST_DEVICE`` (default cpu, where the
staging runs synchronously; ``make gpu-check`` sets cuda: side stream + events).
"""

from __future__ import annotations

import gc
import multiprocessing
import os

import pytest
import torch

from vllm_omni_kv import KVCacheTransferData
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.device_staging import DeviceStager, canonical_device
from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks, inject_request_blocks
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.testing.layout_emulator import (
    EmulatedEngine,
    build_caches,
    read_tokens,
    reference_tokens,
    write_tokens,
)

DEVICE = os.environ.get("OMNIKV_TEST_DEVICE", "cpu")
SEQ = 100
SRC_IDS = [7, 2, 9, 4]
DST_IDS = [1, 5, 0, 8]
ENGINES = {
    "flash-LBNHC": EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC"),
    "flash-BLHNC": EmulatedEngine(backend="FLASH_ATTN", layout="BLHNC"),
    "flashinfer-HND-kernel16": EmulatedEngine(
        backend="FLASHINFER", layout="LBHNC", kernel_block_size=16
    ),
    "mla-LBNHC": EmulatedEngine(backend="FLASHMLA", layout="LBNHC", head_size=64),
    "cpu": EmulatedEngine(backend="CPU_ATTN", layout="LBHNC"),
}


def _engine(name: str, dtype: str) -> EmulatedEngine:
    return EmulatedEngine(**{**ENGINES[name].__dict__, "dtype": dtype, "device": DEVICE})


def _round_trip(e: EmulatedEngine, stager: DeviceStager | None) -> list[object]:
    src, dst = build_caches(e), build_caches(e)
    ref = reference_tokens(e, SEQ, seed=3)
    write_tokens(e, src, SRC_IDS, ref)
    ident = _identity(e, next(iter(src.values())))
    data = extract_request_blocks(
        "r", SRC_IDS, SEQ, list(src.values()), layout=ident, stager=stager
    )
    wire = KVCacheTransferData.from_bytes(data.to_bytes())
    del data
    assert inject_request_blocks(wire, list(dst.values()), DST_IDS, layout=ident) == SEQ
    got = read_tokens(e, dst, DST_IDS, SEQ)
    for layer, ((rk, rv), (gk, gv)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(gk, rk), f"layer {layer}: K differs"
        if rv is not None:
            assert gv is not None and torch.equal(gv, rv), f"layer {layer}: V differs"
    return got


def _identity(e: EmulatedEngine, view: torch.Tensor) -> KVLayoutId:
    """The identity vLLM's configs give the connector for this engine."""
    facts = EngineLayout(
        block_size=e.block_size,
        layout=e.layout,
        backend=e.backend,
        use_mla=e.packing == "latent",
        cache_dtype=e.cache_dtype,
    )
    return facts.identity(view)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("name", list(ENGINES))
def test_layout_staged_payload_matches_kernel_tokens(name: str, dtype: str) -> None:
    e = _engine(name, dtype)
    stager = DeviceStager(DEVICE)
    _round_trip(e, stager)
    assert stager.gathers == 1 and stager.fallbacks == 0
    gc.collect()
    # every layer was copied out: the buffer is back and reused by the next request
    assert len(stager._free) == 1
    held = stager.held_bytes
    _round_trip(e, stager)
    assert stager.held_bytes == held and stager.gathers == 2


def test_layout_staging_falls_back_when_a_request_does_not_fit() -> None:
    e = _engine("flash-LBNHC", "bfloat16")
    stager = DeviceStager(DEVICE, max_bytes=4096)  # less than the request's pages
    _round_trip(e, stager)  # read from the cache directly, still token-exact
    assert stager.gathers == 0 and stager.fallbacks == 1 and stager.held_bytes == 0


def test_layout_staging_buffer_returns_when_a_payload_is_dropped_unsent() -> None:
    e = _engine("flash-LBNHC", "bfloat16")
    caches = build_caches(e)
    stager = DeviceStager(DEVICE)
    layers = list(caches.values())
    ident = _identity(e, layers[0])
    data = extract_request_blocks("r", SRC_IDS, SEQ, layers, layout=ident, stager=stager)
    assert not stager._free
    del data  # e.g. the send failed before packing
    gc.collect()
    assert len(stager._free) == 1


def test_layout_stager_refuses_other_device_and_bad_bound() -> None:
    with pytest.raises(ConfigError, match="staging_bytes"):
        DeviceStager("cpu", max_bytes=0)
    stager = DeviceStager("meta")
    with pytest.raises(ConfigError, match="stager"):
        stager.gather([torch.zeros(4, 2, 32, 128)], [0])


def test_device_names_resolve_to_what_tensors_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.device("cuda")`` differs from the ``cuda:0`` its tensors report: a name
    without an index is the current device, and the host has no index."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device("cuda") == torch.device("cuda", 1)
    assert canonical_device("cuda:0") == torch.device("cuda", 0)
    assert canonical_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    assert canonical_device("cpu:0") == torch.zeros(1).device
    assert canonical_device("meta") == torch.device("meta")


def test_layout_stager_named_differently_from_its_tensors_stages() -> None:
    """Host: "cpu:0" against tensors on "cpu"; CUDA: "cuda" against tensors on "cuda:0"."""
    e = _engine("flash-LBNHC", "bfloat16")
    stager = DeviceStager("cpu:0" if DEVICE == "cpu" else torch.device(DEVICE).type)
    _round_trip(e, stager)
    assert stager.gathers == 1 and stager.fallbacks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_ordered_after_the_forward_stream() -> None:
    """A write queued on the forward stream before the gather is what the payload carries,
    and a write queued after it (the next step reusing the block) is not."""
    e = _engine("flash-LBNHC", "bfloat16")
    e = EmulatedEngine(**{**e.__dict__, "device": "cuda"})
    caches = build_caches(e)
    layers = list(caches.values())
    stager = DeviceStager("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the forward stream busy
    for c in layers:
        c.fill_(3)
    data = extract_request_blocks(
        "r", SRC_IDS, SEQ, layers, layout=_identity(e, layers[0]), stager=stager
    )
    for c in layers:
        c.fill_(5)  # queued after the gather: must not be seen
    wire = KVCacheTransferData.from_bytes(data.to_bytes())
    for raw in wire["layer_blocks"]["kv_blocks"]:
        assert bool((raw.float() == 3).all())


def _segment_pin_without_cuda(namespace: str) -> None:
    """In a child that never initialized CUDA: a pooled segment asks for no registration."""
    from vllm_omni_kv.backends.shm.producer import ProducerArena

    pa = ProducerArena(8 << 20, namespace=namespace)
    try:
        seg, pooled = pa.acquire(1 << 20)
        ok = pooled and seg.mm.pin is None and not torch.cuda.is_initialized()
        pa.release_unpublished(seg, pooled)
    finally:
        pa.close()
    raise SystemExit(0 if ok else 3)


def test_shm_segments_are_not_registered_without_cuda_in_use() -> None:
    """A process that never initialized CUDA maps segments as plain memory (a forked child:
    this process may have used CUDA in an earlier test; torch does not count a parent's
    CUDA as initialized in a forked child)."""
    proc = multiprocessing.get_context("fork").Process(
        target=_segment_pin_without_cuda, args=(f"pin-{os.getpid()}",)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shm_segments_are_pinned_while_mapped() -> None:
    """In a process using CUDA, arena segments are registered (in the background: DMA,
    async copies once it lands) and unregistered before they are unmapped."""
    from vllm_omni_kv.backends.shm.producer import ProducerArena

    torch.zeros(1, device="cuda")  # CUDA in use, as in a GPU worker
    pa = ProducerArena(8 << 20, namespace=f"pin-{os.getpid()}")
    try:
        seg, pooled = pa.acquire(1 << 20)
        pin = seg.mm.pin
        assert pooled and pin is not None and pin.wait(30) and pin.pinned
        assert torch.frombuffer(seg.mm, dtype=torch.uint8).is_pinned()
        pa.release_unpublished(seg, pooled)
    finally:
        pa.close()
    assert seg.mm.closed and not pin.pinned


# -- ordering of copies out of a staging buffer (issue 24, item 2) -----------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staged_copy_into_device_memory_is_ordered_after_the_packer_and_before_its_next_use() -> (
    None
):
    """Packing a frame on the device: the frame's zero fill is queued on the packing
    thread's stream, the layer's copy on the stager's side stream. The copy must run
    after the fill (else the layer goes out as zeros) and before the packing stream's next
    use of the frame (the copy into a pool block), with no host wait. Checked with
    recording streams on host tensors."""
    fake = RecordingStreams()
    views = [torch.randn(12, 2, 16, 64), torch.randn(12, 2, 16, 64)]
    ids = [3, 7, 1]
    with device_order.installed("cpu", fake):
        stager = DeviceStager("cpu")
        staged = stager.gather(views, ids)
        assert staged is not None
        fill = fake.work(fake.forward, "the frame's zero fill")
        dst = torch.zeros(len(ids), 2, 16, 64)
        assert list(staged.fill(0)(dst)) == [dst.numel() * dst.element_size()]
        next_use = fake.work(fake.forward, "copy of the frame into the pool block")
    ids_upload, copy = fake.queued(stager.side, "copy_")
    gather = fake.queued(stager.side, "index_select")[0]
    assert torch.equal(dst, views[0][ids])
    assert fake.before(fill, copy), "the layer's copy may run before the frame's zero fill"
    assert fake.before(copy, next_use), "the frame's next use may run before the copy"
    assert fake.before(ids_upload, gather) and fake.before(gather, copy)
    assert not fake.host_waits, "the copy into device memory made the host wait"


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_frame_holds_every_layer_while_the_forward_is_busy() -> None:
    """A staged payload packed on the GPU (a device pool's frame) while the forward stream
    is busy before and after the gather: every layer arrives, none as zeros."""
    from vllm_omni_kv.kvcache.cache_layout import page_view
    from vllm_omni_kv.wire import codec

    e = EmulatedEngine(**{**_engine("flash-LBNHC", "bfloat16").__dict__, "device": "cuda"})
    caches = build_caches(e)
    layers = list(caches.values())
    write_tokens(e, caches, SRC_IDS, reference_tokens(e, SEQ, seed=5))
    ident = _identity(e, layers[0])
    index = torch.tensor(SRC_IDS, device="cuda")
    expect = [page_view(c, ident).index_select(0, index).cpu() for c in layers]
    stager = DeviceStager("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the forward still running when the gather is queued
    data = extract_request_blocks("r", SRC_IDS, SEQ, layers, layout=ident, stager=stager)
    torch.cuda._sleep(100_000_000)  # more forward work queued before the frame is packed
    packed = data.frame().to_device_tensor("cuda")
    got = codec.decode_tensor(packed)["layer_blocks"]["kv_blocks"]
    assert len(got) == len(expect)
    for i, (raw, want) in enumerate(zip(got, expect, strict=True)):
        assert torch.equal(
            raw.cpu().view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        ), f"layer {i} differs from the cache's pages"
