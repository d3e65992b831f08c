"""A move between a device cache and host memory costs the same device operations and host
waits at any page count (issue 30: staged D2H, inject H2D, frame packing).

The device branch runs on host tensors with ``RecordingStreams`` installed for "cpu": each
stream records the torch calls queued on it, events and waits, and the host's waits. For
4, 64 and 1,024 pages of three layers the recorded operations must be the same, and the
bytes those of the cache: vLLM's FlashAttention layout keeps block ``b`` of a layer at
``b * page bytes`` of that layer's memory (the per-page reference below), whatever the
view the engine hands over.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from vllm_omni_kv import KVCacheTransferData
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.receive import device_writes
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.device_staging import DeviceStager
from vllm_omni_kv.kvcache.paged_blocks import (
    extract_request_blocks,
    inject_request_blocks,
    plan_block_injection,
)
from vllm_omni_kv.kvcache.token_major import extract_request_kv, inject_request_kv
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.testing.layout_emulator import EmulatedEngine, build_caches
from vllm_omni_kv.transfer.parts import split_payload
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.codec import LazyTensor
from vllm_omni_kv.wire.stream import CompleteStream

SIZES = [4, 64, 1024]
LAYERS = 3
BLOCK = 16
ENGINE = EmulatedEngine(
    backend="FLASH_ATTN",
    layout="LBNHC",
    dtype="bfloat16",
    num_layers=LAYERS,
    num_blocks=2 * max(SIZES) + 8,
    block_size=BLOCK,
    kv_heads=2,
    head_size=8,
)


def _caches(seed: int) -> list[torch.Tensor]:
    layers = list(build_caches(ENGINE).values())
    g = torch.Generator().manual_seed(seed)
    for c in layers:
        c.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, c.shape, generator=g))
    return layers


def _identity(view: torch.Tensor) -> KVLayoutId:
    facts = EngineLayout(block_size=BLOCK, layout="LBNHC", backend="FLASH_ATTN")
    return facts.identity(view)


def _blocks(cache: torch.Tensor) -> torch.Tensor:
    """The layer's memory as ``[blocks, page bytes]``: block ``b`` at ``b * page bytes``."""
    page = cache.stride(0)  # elements per block: the layer's blocks are back to back
    whole = cache.as_strided((cache.shape[0], page), (page, 1), cache.storage_offset())
    return whole.contiguous().view(torch.uint8)


def _ids(n: int, seed: int) -> list[int]:
    """``n`` scattered block ids (a long-running server's shuffled block table)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(ENGINE.num_blocks, generator=g)[:n].tolist()


def _recorded(fake: RecordingStreams) -> Counter[tuple[str, str, str]]:
    """Every queued entry by stream role, kind and torch call, plus the host's waits."""
    out: Counter[tuple[str, str, str]] = Counter()
    for name, s in fake.streams.items():
        role = name.split("#")[0].split("-")[0]
        for kind, detail in s.ops:
            out[(role, kind, str(detail) if kind == "work" else "")] += 1
    out[("host", "wait", "")] = len(fake.host_waits)
    return out


def _page_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_staged_d2h_costs_the_same_at_any_page_count() -> None:
    """Gather (ids uploaded once, one ``index_select`` per layer) and pack (one copy out of
    the staging buffer for the whole frame): equal at 4, 64 and 1,024 pages."""
    seen = {}
    for n in SIZES:
        caches, ids = _caches(n), _ids(n, seed=n)
        fake = RecordingStreams()
        with device_order.installed("cpu", fake):
            stager = DeviceStager("cpu")
            data = extract_request_blocks(
                "r", ids, n * BLOCK, caches, layout=_identity(caches[0]), stager=stager
            )
            frame = data.to_bytes()
        seen[n] = _recorded(fake)
        side = stager.side
        assert len(fake.queued(side, "copy_")) == 2, "ids upload + one copy out of staging"
        assert len(fake.queued(side, "index_select")) == LAYERS
        assert not fake.queued(side, "tensor"), "block ids built in the move"
        got = KVCacheTransferData.from_bytes(frame)["layer_blocks"]["kv_blocks"]
        for layer, cache in enumerate(caches):
            ref = _blocks(cache)
            for j, b in enumerate(ids):
                assert torch.equal(_page_bytes(got[layer][j]), ref[b]), (n, layer, j)
    assert seen[4] == seen[64] == seen[1024]


def test_block_id_uploads_never_wait_on_the_host_while_the_device_is_busy() -> None:
    """Requests staged one after another in a step whose forward still runs: each move's
    block ids go up without a host wait (the kept pinned buffer is still being read, so
    the next upload takes a buffer of its own), and each move's ids are exact."""
    from vllm_omni_kv.kvcache.device_scratch import MoveScratch

    fake = RecordingStreams()
    fake.busy = True  # every event reports its work still queued, as behind a forward
    scratch = MoveScratch(torch.device("cpu"), fake)
    for ids in ([3, 1, 2], [7, 5], list(range(2000)), [9]):
        with scratch.use():
            assert scratch.ids(ids).tolist() == ids
    assert fake.host_waits == []


def test_each_part_of_a_staged_payload_is_one_copy() -> None:
    """Layer-wise parts: each part's frame takes its own layers in one copy."""
    n = 64
    caches, ids = _caches(7), _ids(n, seed=7)
    fake = RecordingStreams()
    with device_order.installed("cpu", fake):
        stager = DeviceStager("cpu")
        data = extract_request_blocks(
            "r", ids, n * BLOCK, caches, layout=_identity(caches[0]), stager=stager
        )
        parts = split_payload(data, max_part_bytes=2 * n * _blocks(caches[0]).shape[1])
        frames = [p.to_bytes() for p in parts]
    assert len(parts) == 2
    assert len(fake.queued(stager.side, "copy_")) == 1 + len(parts)
    got = [
        t for f in frames for t in KVCacheTransferData.from_bytes(f)["layer_blocks"]["kv_blocks"]
    ]
    for layer, cache in enumerate(caches):
        ref = _blocks(cache)
        assert all(torch.equal(_page_bytes(got[layer][j]), ref[b]) for j, b in enumerate(ids))
    assert stager._free, "the staging buffer went back once every layer was packed"


def test_staged_frame_padding_is_zero_and_layers_exact() -> None:
    """Pages whose size is not a multiple of the frame's alignment: the padding the one
    copy carries into the frame is zeros (as the host packer writes it)."""
    views = [torch.randint(1, 255, (9, 5), dtype=torch.uint8) for _ in range(3)]
    ids = [4, 1, 7]
    with device_order.installed("cpu", RecordingStreams()):
        stager = DeviceStager("cpu")
        staged = stager.gather(views, ids)
        assert staged is not None
        lazies = [
            LazyTensor((3, 5), torch.uint8, staged.fill(i), place=staged.place(i)) for i in range(3)
        ]
        frame = codec.encode({"kv": lazies})
        raw = bytes(frame.to_bytearray())
    assert staged.copies == 1
    got = codec.decode(bytearray(raw))["kv"]
    for v, t in zip(views, got, strict=True):
        assert torch.equal(t, torch.stack([v[b] for b in ids]))
    for _dt, _shape, off, nbytes in frame.tensor_table:
        pad = raw[frame.data_start + off + nbytes : frame.data_start + codec.align_up(off + nbytes)]
        assert pad == bytes(len(pad))


def _payload(n: int) -> tuple[list[torch.Tensor], list[int], dict[str, Any]]:
    src, ids = _caches(100 + n), _ids(n, seed=100 + n)
    data = extract_request_blocks("r", ids, n * BLOCK, src, layout=_identity(src[0]))
    return src, ids, KVCacheTransferData.from_bytes(data.to_bytes())


@pytest.mark.parametrize("how", ["inject", "plan"])
def test_inject_h2d_costs_the_same_at_any_page_count(how: str) -> None:
    """Ids uploaded once, the frame's bytes in one copy, one ``index_copy_`` per layer and
    one host wait for the move: equal at 4, 64 and 1,024 pages."""
    seen = {}
    for n in SIZES:
        src, ids, wire = _payload(n)
        dst, dst_ids = _caches(0), _ids(n, seed=999)
        for c in dst:
            c.zero_()
        ident = _identity(dst[0])
        fake = RecordingStreams()
        with device_order.installed("cpu", fake), device_writes(torch.device("cpu")):
            if how == "inject":
                assert inject_request_blocks(wire, dst, dst_ids, layout=ident) == n * BLOCK
            else:
                plan = plan_block_injection(wire, dst, dst_ids, layout=ident)
                stream = CompleteStream(wire, 0)
                assert plan.apply(stream, deadline=float("inf")) == n * BLOCK
        seen[n] = _recorded(fake)
        (side,) = fake.side_streams()
        assert len(fake.queued(side, "copy_")) == 2, "ids upload + one upload of the frame"
        assert not fake.queued(side, "tensor") and not fake.queued(side, "to"), (
            "an upload per layer"
        )
        assert len(fake.queued(side, "index_copy_")) == LAYERS
        for s, d in zip(src, dst, strict=True):
            ref, out = _blocks(s), _blocks(d)
            for b, db in zip(ids, dst_ids, strict=True):
                assert torch.equal(out[db], ref[b])
            untouched = sorted(set(range(ENGINE.num_blocks)) - set(dst_ids))
            assert not out[untouched].any(), "a block outside the request was written"
    assert seen[4] == seen[64] == seen[1024]


def _flash(seed: int) -> list[torch.Tensor]:
    """FlashAttention caches as vLLM allocates them: ``[2, blocks, block_size, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, ENGINE.num_blocks, BLOCK, 2, 8)
    return [torch.randint(-(2**15), 2**15, shape, generator=g).to(torch.int16) for _ in range(3)]


def test_token_major_inject_costs_the_same_at_any_page_count() -> None:
    """Token-major payloads: block ids checked on the host and uploaded once, per layer
    K and V each one upload and one ``index_copy_``, one host wait for the move."""
    seen = {}
    for n in SIZES:
        src, ids = _flash(200 + n), _ids(n, seed=200 + n)
        data = extract_request_kv("r", ids, n * BLOCK, src, layout="flash")
        wire = KVCacheTransferData.from_bytes(data.to_bytes())
        dst, dst_ids = [torch.zeros_like(c) for c in src], _ids(n, seed=998)
        fake = RecordingStreams()
        with device_order.installed("cpu", fake), device_writes(torch.device("cpu")):
            assert inject_request_kv(wire, dst, dst_ids, layout="flash") == n * BLOCK
        seen[n] = _recorded(fake)
        (side,) = fake.side_streams()
        assert len(fake.queued(side, "index_copy_")) == 2 * LAYERS
        assert not fake.queued(side, "tensor"), "block ids built per layer"
        assert len(fake.host_waits) == 2, "the move's wait and the load's"
        for s, d in zip(src, dst, strict=True):
            for b, db in zip(ids, dst_ids, strict=True):
                assert torch.equal(d[:, db], s[:, b])  # K and V of the block
            untouched = sorted(set(range(ENGINE.num_blocks)) - set(dst_ids))
            assert not d[:, untouched].any(), "a block outside the request was written"
    assert seen[4] == seen[64] == seen[1024]


def test_token_major_extraction_costs_the_same_at_any_page_count() -> None:
    """Token-major payloads out of a device cache: block ids uploaded once, each layer's K
    and V rows one ``index_select`` (plus one copy of a partial last block) into one
    staging buffer, then one copy out of it for the frame (on the host, recorded as a device
    copy: no host wait; on a GPU one for the frame, ``device_staging``); the rows
    those of the cache: token ``t`` is row ``t % block`` of block ``ids[t // block]``."""
    seen = {}
    for n in SIZES:
        src, ids = _flash(300 + n), _ids(n, seed=300 + n)
        tokens = n * BLOCK - 5  # a partial last block
        fake = RecordingStreams()
        with device_order.installed("cpu", fake):
            stager = DeviceStager("cpu")
            data = extract_request_kv("r", ids, tokens, src, layout="flash", stager=stager)
            frame = data.to_bytes()
        seen[n] = _recorded(fake)
        side = stager.side
        assert stager.gathers == 1
        assert len(fake.queued(side, "index_select")) == 2 * LAYERS
        assert len(fake.queued(side, "copy_")) == 1 + 2 * LAYERS + 1, "ids, tails, copy out"
        got = KVCacheTransferData.from_bytes(frame)["layer_blocks"]
        for layer, cache in enumerate(src):
            for kv, name in enumerate(("key_cache", "value_cache")):
                rows = cache[kv][ids].reshape(-1, 2, 8)[:tokens]  # vLLM's [2, blocks, bs, h, d]
                assert torch.equal(got[name][layer], rows), (n, layer, name)
    assert seen[4] == seen[64] == seen[1024]


def test_a_converting_injection_builds_its_ids_once() -> None:
    """Pages of another layout (NHD payload into an HND cache) are converted token by
    token, layer by layer: the block ids go to the device once for the move, not once
    per layer; the tokens land where vLLM's HND cache keeps them."""
    hnd = EmulatedEngine(**{**ENGINE.__dict__, "layout": "LBHNC"})
    facts = EngineLayout(block_size=BLOCK, layout="LBHNC", backend="FLASH_ATTN")
    for n in SIZES:
        src, ids, wire = _payload(n)
        dst = list(build_caches(hnd).values())
        for c in dst:
            c.zero_()
        dst_ids = _ids(n, seed=997)
        ident = facts.identity(dst[0])
        assert not ident.same_pages(_identity(src[0])), "the test needs a conversion"
        fake = RecordingStreams()
        with device_order.installed("cpu", fake), device_writes(torch.device("cpu")):
            plan = plan_block_injection(wire, dst, dst_ids, layout=ident)
            assert plan.apply(CompleteStream(wire, 0), deadline=float("inf")) == n * BLOCK
        (side,) = fake.side_streams()
        assert len(fake.queued(side, "tensor")) <= 1, "block ids built per layer"
        for s, d in zip(src, dst, strict=True):  # same logical [block, head, token, K|V]
            assert d.stride() != s.stride()
            for b, db in zip(ids, dst_ids, strict=True):
                assert torch.equal(
                    d[db].contiguous().view(torch.int16), s[b].contiguous().view(torch.int16)
                )
