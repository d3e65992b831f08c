"""Structure-aware fuzzing of the consumer's whole load path: decode -> plan -> apply.

Three real payloads of one request (paged blocks, token-major K/V, shared pages over a
producer cache in a real ``/dev/shm`` segment with a real hold) are framed as a
producer frames them. Each case takes one frame's header apart (tensor table and
object tree), mutates it (wrong types, other numbers, swapped fields, nesting, bad
layout identities, geometry, digests, block ids), re-packs it with every digest and
the checksum recomputed (``_frame_forge``), and runs what a consumer runs on a
received frame: ``ArrivedFrameStream`` (decode), the connector's ``check_payload``,
``plan_injection`` into vLLM-like CPU caches and ``plan.apply``.

Only ``KVPayloadError`` may escape, or the load succeeds; a success writes only inside
the request's blocks of the local caches (guard bytes around every layer and every
other block stay as they were), and an unmutated frame writes exactly the producer's
tokens (checked against ``reference_kv``, explicit loops). For shared pages a
``KVTransferError`` is also a refusal (a hold that is gone, a segment of another
producer): the transport's answer for a payload that names what no longer exists.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from _frame_forge import header_paths, repack, split
from _kv_fixtures import GuardedLayers, ShmRegions, reference_kv, shm_namespace
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.metadata import LoadSpec
from vllm_omni_kv.connector.receive import check_payload, layer_caches, token_caches
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.formats import plan_injection
from vllm_omni_kv.kvcache.head_shards import merge_received_rank_shards
from vllm_omni_kv.kvcache.paged_blocks import (
    blocks_to_tokens,
    extract_request_blocks,
    is_block_payload,
)
from vllm_omni_kv.kvcache.shared_pages import describe_request, is_shared_payload, layer_geometry
from vllm_omni_kv.kvcache.token_major import extract_request_kv, inject_request_kv
from vllm_omni_kv.transfer.parts import join_parts, part_info, part_layer_count
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import ArrivedFrameStream

LAYERS, HEADS, BS, DIM, NBLOCKS = 2, 2, 16, 8, 8
SEQ = 40  # 3 blocks, the last one partly used
SRC_IDS, DST_IDS = [5, 1, 6], [2, 7, 0]
DIGEST = "dg"
ENGINE = EngineLayout(BS, "LBHNC", "CPU_ATTN")
IDENT = KVLayoutId("kt_v", "LBHNC", "bfloat16", BS, BS, HEADS, DIM, 2, "CPU_ATTN")
LAYER_BYTES = NBLOCKS * HEADS * BS * 2 * DIM * 2
GUARD = 4096  # bytes of known pattern before, between and after the local layers
KINDS = ("paged_blocks", "token_major", "shared_pages")


class Producer(ShmRegions):
    """The producer's cache in a real shared-memory cache segment, its three payloads
    framed, and the consumer's view of that region."""

    def __init__(self, ns: str) -> None:
        super().__init__(ns, LAYERS * LAYER_BYTES, seed=11)
        self.caches = [
            self.cache[i * LAYER_BYTES : (i + 1) * LAYER_BYTES]
            .view(torch.bfloat16)
            .view(NBLOCKS, HEADS, BS, 2 * DIM)
            for i in range(LAYERS)
        ]
        self.frames = {k: bytes(self._frame(k)) for k in KINDS}
        self.shards = {k: self._shard_frames(k) for k in KINDS[:2]}

    def _frame(self, kind: str) -> bytearray:
        md = {"prompt_digest": DIGEST}
        if kind == "paged_blocks":
            data = extract_request_blocks("t", SRC_IDS, SEQ, self.caches, layout=IDENT, metadata=md)
            return codec.encode(data.to_dict(), IDENT.page_bytes).to_bytearray()
        if kind == "token_major":
            layers = [kv for kv in (ly.kv for ly in layer_caches(self._named(), ENGINE))]
            data = extract_request_kv("t", SRC_IDS, SEQ, layers, metadata=md)  # type: ignore[arg-type]
            return codec.encode(data.to_dict(), 512).to_bytearray()
        got = self.region.export(self.caches)
        assert got is not None
        desc, base, nbytes = got
        geometry = layer_geometry(self.caches, base, nbytes)
        shared = {"region": desc, "hold": self.hold(), "geometry": geometry}
        data = describe_request(
            "t", SRC_IDS, SEQ, self.caches, IDENT, shared, digests=True, metadata=md
        )
        return codec.encode(data.to_dict(), 512).to_bytearray()

    def _shard_frames(self, kind: str) -> list[bytes]:
        """The frames of two producer TP ranks, one KV head each (a TP 2 -> 1 load)."""
        out = []
        for rank in range(2):
            caches = [c[:, rank : rank + 1].contiguous() for c in self.caches]
            ident = KVLayoutId(**{**IDENT.to_dict(), "kv_heads": 1})
            md = {"prompt_digest": DIGEST}
            if kind == "paged_blocks":
                data = extract_request_blocks("t", SRC_IDS, SEQ, caches, layout=ident, metadata=md)
            else:
                kv = [
                    ly.kv for ly in layer_caches({f"l{i}": c for i, c in enumerate(caches)}, ENGINE)
                ]
                data = extract_request_kv("t", SRC_IDS, SEQ, kv, metadata=md)  # type: ignore[arg-type]
            out.append(bytes(codec.encode(data.to_dict(), 512).to_bytearray()))
        return out

    def _named(self) -> dict[str, torch.Tensor]:
        return {f"layer{i}": c for i, c in enumerate(self.caches)}

    def hold(self) -> str:
        """The payload's hold, created again when a load consumed it."""
        name = self.region.hold_name("prefill", "decode", "k")
        if not os.path.exists(arena.path(name)):
            self.region.hold("prefill", "decode", "k")
        return name

    def close(self) -> None:
        self.region.release(self.region.hold_name("prefill", "decode", "k"))
        super().close()


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    with shm_namespace("fz") as ns:
        p = Producer(ns)
        yield p
        p.close()


class Local(GuardedLayers):
    """The consumer's layers, with guard bytes around each."""

    def __init__(self) -> None:
        super().__init__(LAYERS, NBLOCKS, HEADS, BS, DIM, GUARD)

    def changed_outside_the_request(self) -> list[str]:
        """Guard bytes or blocks other than ``DST_IDS`` that differ from before."""
        out = [f"guard {i}" for i in self.spoiled_guards()]
        return out + [
            f"layer {i} block {b}" for i, b in sorted(self.changed_pages()) if b not in DST_IDS
        ]


def load(buf: bytearray, producer: Producer, local: Local, start: int) -> int:
    """What a consumer runs on a received frame (``connector/receive.py``'s one-key path)."""
    spec = LoadSpec("r", "t", DST_IDS, start, SEQ - start, SEQ, DIGEST)
    layers = layer_caches({f"layer{i}": c for i, c in enumerate(local.caches)}, ENGINE)
    with ArrivedFrameStream(buf) as stream:
        stream.authenticate(None)
        part = stream.obj
        check_payload(part, spec, BS)
        if is_shared_payload(part):
            plan = plan_injection(
                part,
                [x.cache for x in layers],
                DST_IDS,
                start_token=start,
                layout=IDENT,
                pages=producer.reader,
                verify=True,
            )
        else:
            info = part_info(part)
            first = 0 if info is None else info[2]
            blocks = is_block_payload(part)
            source: list[Any] = [x.cache for x in layers] if blocks else token_caches(layers)
            plan = plan_injection(
                part,
                source[first : first + part_layer_count(part)],
                DST_IDS,
                start_token=start,
                layout=IDENT if blocks else None,
            )
        return plan.apply(stream, time.monotonic() + 5.0)


def load_merged(frames: list[bytearray], local: Local, start: int) -> None:
    """The consumer's load from several producer ranks (``receive``'s merging path): each
    payload fetched whole (``TransferSession.fetch``: loaded, parts joined), checked,
    made token-major, the head shards merged and the missing tokens written."""
    spec = LoadSpec("r", "t", DST_IDS, start, SEQ - start, SEQ, DIGEST)
    layers = layer_caches({f"layer{i}": c for i, c in enumerate(local.caches)}, ENGINE)
    payloads = []
    for buf in frames:
        with ArrivedFrameStream(buf) as stream:
            stream.authenticate(None)
            for _ in stream.load(None, time.monotonic() + 5.0):
                pass
            obj = join_parts([stream.obj])
        check_payload(obj, spec, BS)
        payloads.append(blocks_to_tokens(obj) if is_block_payload(obj) else obj)
    merged = merge_received_rank_shards(payloads)
    assert merged is not None
    inject_request_kv(merged, token_caches(layers), DST_IDS, start_token=start, num_tokens=SEQ)


def _assert_reference(producer: Producer, local: Local, start: int) -> None:
    for d, s in zip(local.caches, producer.caches, strict=True):
        want_k, want_v = reference_kv(s, SRC_IDS, SEQ)
        got_k, got_v = reference_kv(d, DST_IDS, SEQ)
        for got, want in ((got_k, want_k), (got_v, want_v)):  # bit patterns: NaNs included
            assert torch.equal(got[start:].view(torch.int16), want[start:].view(torch.int16))


@pytest.mark.parametrize("start", [0, BS])
@pytest.mark.parametrize("kind", KINDS)
def test_unmutated_frames_load_the_producers_tokens(
    producer: Producer, kind: str, start: int
) -> None:
    """The harness itself: each kind, split and re-packed unchanged, loads exactly."""
    producer.hold()
    header, data, chunk = split(producer.frames[kind])
    local = Local()
    assert load(repack(header, data, chunk), producer, local, start) == SEQ - (
        start if kind == "shared_pages" else 0
    )
    _assert_reference(producer, local, start)
    assert local.changed_outside_the_request() == []


@pytest.mark.parametrize("kind", KINDS[:2])
def test_unmutated_shards_merge_into_the_producers_tokens(producer: Producer, kind: str) -> None:
    local = Local()
    load_merged([repack(*split(f)) for f in producer.shards[kind]], local, BS)
    _assert_reference(producer, local, BS)
    assert local.changed_outside_the_request() == []


# -- mutations -----------------------------------------------------------------------------
WEIRD: list[Any] = [
    None, True, False, -1, 0, 1, 2, 3, 15, 16, 17, 40, 63, 2**31, 2**32 + 1, 2**62, 2**63 - 1,
    2**64 - 1, -(2**63), 1.5, 40.0, math.nan, math.inf, -math.inf, "", "40", "bfloat16",
    "float32", "int8", "fp8_e4m3", "LBNHC", "kt_v", "latent", "paged_blocks", "token_major",
    "shared_pages", "omnikv_hold_x", "omnikv_seg_1_x", "../../etc/passwd", b"\x00" * 4, [], {},
    [[]], [0], [1, 2, 3], [2**40, 2**40], [-1, 4], [0, 2**64 - 1], [[0, [1], [1]]],
    [[0, [1, 1, 1, 1], [1, 1, 1, 1]]], [[0, [8, 2, 16, 16], [512, 256, 16, 1]]],
    [[2**60, [8, 2, 16, 16], [512, 256, 16, 1]]], [[0, [2**40, 2, 16, 16], [0, 0, 0, 0]]],
    [[0, [8, 2, 16, 16], [-512, 256, 16, 1]]], [[0, [8, 2, 16, 16], [2**62, 2**62, 1, 1]]],
    [[0, [8.5, 2, 16, 16], [512, 256, 16, 1]]], [[None, None, None]], [[1, 2], [3]],
    [[2**64 - 1] * 3], ["float32", [1], 0, 4], ["bfloat16", [3, 2, 8], 0, 96],
    ["bfloat16", [2**40, 2**40], 0, 4], ["bfloat16", [0, 2**62], 0, 0], ["uint8", [1] * 9, 0, 1],
    {"a": {"b": []}}, {1: 2, None: 3}, {"kind": "shm", "name": "omnikv_seg_1_x", "owner": 0},
    {**IDENT.to_dict(), "kv_heads": 4}, {**IDENT.to_dict(), "dtype": "float16"},
    {**IDENT.to_dict(), "block_size": 32}, {**IDENT.to_dict(), "kernel_block_size": 8},
    {**IDENT.to_dict(), "packing": "k_v"}, {**IDENT.to_dict(), "layout": "LBNHC"},
    {**IDENT.to_dict(), "packing": "latent", "kv_heads": 1},
    {**IDENT.to_dict(), "head_size": 2**62}, {**IDENT.to_dict(), "element_size": 2**62},
    {**IDENT.to_dict(), "block_size": 2**40, "kernel_block_size": 2**40},
    {**IDENT.to_dict(), "kv_heads": "2"}, {**IDENT.to_dict(), "layout": None},
    msgpack.ExtType(1, b"\xff\xff\xff\xff"), msgpack.ExtType(1, b"\x00\x00\x00\x00"),
    msgpack.ExtType(2, b"\x00\x00\x00\x00"), msgpack.ExtType(1, b"\x01\x00\x00\x00"),
]  # fmt: skip


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def _nudged(v: Any) -> list[Any]:
    """Numbers near ``v`` (an int field's likely off-by-one and overflow values), as far
    as msgpack can carry them."""
    if not isinstance(v, int) or isinstance(v, bool):
        return []
    near = [v - 1, v + 1, v * 2, v // 2, -v, v + 2**32, v + 2**63 - 1, v * BS, v ^ 1]
    return [n for n in near if -(2**63) <= n < 2**64]


def _entry_variants(e: Any) -> list[Any]:
    """A tensor table entry ``[dtype, shape, offset, nbytes]`` changed so that it still
    decodes: dims permuted, merged or split, another dtype of a fitting width, fewer
    rows, a shifted offset. What decides is then the plan's check of the tensor."""
    if not (isinstance(e, list) and len(e) == 4 and isinstance(e[1], list) and e[1]):
        return []
    dt, shape, off, nb = e
    if not all(isinstance(d, int) for d in shape) or not isinstance(off, int):
        return []
    last, n = shape[-1], math.prod(shape)
    out = [
        [dt, shape[::-1], off, nb],
        [dt, [n], off, nb],
        [dt, [1, *shape], off, nb],
        [dt, [*shape[:-1], last // 2, 2] if last % 2 == 0 else shape, off, nb],
        [dt, [shape[0] * shape[1], *shape[2:]] if len(shape) > 1 else shape, off, nb],
        ["float16", shape, off, nb],
        ["int16", shape, off, nb],
        ["uint8", [*shape[:-1], last * 2], off, nb],
        ["float32", [*shape[:-1], last // 2], off, nb] if last % 2 == 0 else e,
        [dt, [max(0, shape[0] - 1), *shape[1:]], off, nb - nb // max(1, shape[0])],
        [dt, [0, *shape[1:]], off, 0],
        [dt, shape, off + 2, nb],
        [dt, shape, max(0, off - 2), nb],
    ]
    return [copy.deepcopy(v) for v in out]


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """``base`` with 1-3 mutations, most of them in the payload object (``"v"``)."""
    header = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in header_paths(header) if p]
        inner = [p for p in paths if p[0] == "v"]
        path = draw(st.sampled_from(inner if inner and draw(st.integers(0, 9)) < 7 else paths))
        node = _get(header, path)
        parent = _get(header, path[:-1])
        action = draw(st.sampled_from(["weird", "nudge", "nudge", "swap", "delete", "wrap", "dup"]))
        if path[0] == "t" and len(path) == 2 and draw(st.booleans()) and _entry_variants(node):
            parent[path[-1]] = draw(st.sampled_from(_entry_variants(node)))
        elif action == "nudge" and _nudged(node):
            parent[path[-1]] = draw(st.sampled_from(_nudged(node)))
        elif action == "swap":  # another field's value here (e.g. rows for num_tokens)
            other = _get(header, draw(st.sampled_from(paths)))
            parent[path[-1]] = copy.deepcopy(other)
        elif action == "delete":
            del parent[path[-1]]
        elif action == "wrap":
            parent[path[-1]] = [node]
        elif action == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(node))
        else:
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(WEIRD)))
    return header


REFUSALS: dict[str, tuple[type[Exception], ...]] = {
    "paged_blocks": (KVPayloadError,),
    "token_major": (KVPayloadError,),
    "shared_pages": (KVPayloadError, KVTransferError),
}


def _fuzz(producer: Producer, kind: str, header: Any, start: int) -> None:
    _base, data, chunk = split(producer.frames[kind])
    if kind == "shared_pages":
        producer.hold()
    local = Local()
    try:
        load(repack(header, data, chunk), producer, local, start)
    except REFUSALS[kind]:
        pass
    assert local.changed_outside_the_request() == []


FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(data=st.data())
def test_fuzz_mutated_frames_only_raise_payload_errors(
    producer: Producer, kind: str, data: st.DataObject
) -> None:
    base = split(producer.frames[kind])[0]
    header = data.draw(mutated(base), label="header")
    start = data.draw(st.sampled_from([0, BS]), label="start")
    _fuzz(producer, kind, header, start)


@pytest.mark.parametrize("kind", KINDS[:2])
@FUZZ
@given(data=st.data())
def test_fuzz_mutated_shards_only_raise_payload_errors(
    producer: Producer, kind: str, data: st.DataObject
) -> None:
    """Two producer ranks' payloads, one of them mutated, through the merging path."""
    frames = [repack(*split(f)) for f in producer.shards[kind]]
    which = data.draw(st.sampled_from([0, 1]), label="shard")
    base, payload, chunk = split(producer.shards[kind][which])
    frames[which] = repack(data.draw(mutated(base), label="header"), payload, chunk)
    local = Local()
    try:
        load_merged(frames, local, data.draw(st.sampled_from([0, BS]), label="start"))
    except KVPayloadError:
        pass
    assert local.changed_outside_the_request() == []


T0, T1 = msgpack.ExtType(1, b"\x00\x00\x00\x00"), msgpack.ExtType(1, b"\x01\x00\x00\x00")
GEO = ("v", "metadata", "shared", "geometry")


@pytest.mark.parametrize(
    ("kind", "merged", "path", "value"),
    [
        ("paged_blocks", False, ("v", "layer_blocks", "kv_blocks", 0), True),
        ("paged_blocks", False, ("v", "layer_blocks", "kv_blocks", 0), T1),  # layers share bytes
        ("paged_blocks", False, ("v", "layer_blocks"), 3),
        ("paged_blocks", False, ("v", "metadata", "kv_layout", "block_size"), T0),
        ("paged_blocks", True, ("v", "layer_blocks", "kv_blocks", 0), True),
        ("token_major", True, ("v", "layer_blocks", "key_cache", 0), 5),
        ("token_major", False, ("v", "layer_blocks"), [1]),
        ("shared_pages", False, (*GEO, 1), None),  # one layer's geometry for two layers
        ("shared_pages", False, (*GEO, 0, 0), math.inf),
        ("shared_pages", False, (*GEO, 0, 1, 0), 8.0),
    ],
)
def test_escapes_found_by_fuzzing_are_payload_errors(
    producer: Producer, kind: str, merged: bool, path: tuple, value: Any
) -> None:
    """Each of these left the load path as AttributeError, RuntimeError, OverflowError,
    ValueError or KVTransferError, or (a float dimension in a layer's geometry) was
    taken for an int."""
    frame = producer.shards[kind][0] if merged else producer.frames[kind]
    header, data, chunk = split(frame)
    if value is None:
        del _get(header, path[:-1])[path[-1]]
    else:
        _set(header, path, value)
    forged, local = repack(header, data, chunk), Local()
    with pytest.raises(KVPayloadError):
        if merged:
            load_merged([forged, repack(*split(producer.shards[kind][1]))], local, 0)
        else:
            producer.hold()
            load(forged, producer, local, 0)
    assert local.changed_outside_the_request() == []
