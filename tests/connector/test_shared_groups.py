"""One copy for a model of several KV cache groups: a shared-pages payload with per-group
block lists, from a producer cache in a real ``/dev/shm`` segment (real holds) into
consumer caches with guard bytes, through the wire codec.

The model is Gemma 3-shaped: layers 0 and 2 attend to a sliding window (group 0, whose
table holds the null block 0 before the window), layers 1 and 3 to every token
(group 1). Expected bytes come from indexing the producer's cache by its tables
(explicit loops); every consumer byte outside the blocks a group keeps must stay as
it was.
"""

from __future__ import annotations

import contextlib
import copy
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _kv_fixtures import GuardedLayers, ShmRegions, shm_namespace

from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.kv_groups import plan_shared
from vllm_omni_kv.connector.metadata import LoadSpec, SaveSpec
from vllm_omni_kv.connector.page_export import PageExport
from vllm_omni_kv.connector.receive import LayerCache, layer_caches
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache import device_order
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.shared_pages import shared_fields
from vllm_omni_kv.kvcache.shared_pages_plan import materialize_pages
from vllm_omni_kv.testing.fake_streams import RecordingStreams
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import ArrivedFrameStream

LAYERS, HEADS, BS, DIM, NBLOCKS = 4, 2, 16, 8, 16
GROUP_OF = [0, 1, 0, 1]  # layer -> KV cache group (0: sliding window, 1: full)
N = 100  # tokens: 7 blocks
NEEDED = 7
DIGEST = "dg"
ENGINE = EngineLayout(BS, "LBHNC", "CPU_ATTN")
IDENT = KVLayoutId("kt_v", "LBHNC", "bfloat16", BS, BS, HEADS, DIM, 2, "CPU_ATTN")
LAYER_BYTES = NBLOCKS * HEADS * BS * 2 * DIM * 2
PAGE = LAYER_BYTES // NBLOCKS
GUARD = 4096
#: the producer's tables: the sliding group keeps blocks 4..6 of the request
PROD_TABLES = [[0, 0, 0, 0, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]
#: the consumer's tables as vLLM allocates them (the same window)
CONS_TABLES = [[0, 0, 0, 0, 3, 5, 8], [2, 4, 6, 12, 13, 14, 15]]


class Producer(ShmRegions):
    """A producer cache in a real shm cache segment, exported, and a consumer's reader."""

    def __init__(self, ns: str) -> None:
        super().__init__(ns, LAYERS * LAYER_BYTES, seed=5)
        caches = [
            self.cache[i * LAYER_BYTES : (i + 1) * LAYER_BYTES]
            .view(torch.bfloat16)
            .view(NBLOCKS, HEADS, BS, 2 * DIM)
            for i in range(LAYERS)
        ]
        self.layers = _grouped({f"layer{i}": c for i, c in enumerate(caches)})
        export = PageExport.create(self.region, self.layers, "shm")
        assert export is not None
        self.export = export

    def payload(self, tables: list[list[int]] = PROD_TABLES, digests: bool = True) -> Any:
        """The payload of a new request (its own hold), as a decoded dict."""
        key = uuid.uuid4().hex[:8]
        hold = self.region.hold("prefill", "decode", key)
        spec = SaveSpec("r", "t", tables[0], N, DIGEST, group_block_ids=tables)
        self.region.digests = digests
        data = self.export.payload(spec, self.layers, hold, {"prompt_digest": DIGEST})
        return data.to_dict()

    def page(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer].cache[block].reshape(-1).view(torch.uint8).clone()


def _grouped(caches: dict[str, torch.Tensor]) -> list[LayerCache]:
    layers = layer_caches(caches, ENGINE)
    for x, g in zip(layers, GROUP_OF, strict=True):
        x.group = g
    return layers


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    with shm_namespace("sg") as ns:
        p = Producer(ns)
        yield p
        p.close()


class Local(GuardedLayers):
    """The consumer's layers (grouped as the engine's), with guard bytes around each."""

    def __init__(self) -> None:
        super().__init__(LAYERS, NBLOCKS, HEADS, BS, DIM, GUARD)
        self.layers = _grouped({f"layer{i}": c for i, c in enumerate(self.caches)})

    def written(self) -> dict[tuple[int, int], torch.Tensor]:
        """``(layer, block) -> page`` of every block that changed; guards must not."""
        assert self.spoiled_guards() == []
        return self.changed_pages()


def _load(p: Producer, local: Local, payload: Any, hit: int = 0, tables: Any = None) -> int:
    """What the consumer runs on the received frame; bytes the copy moved."""
    tables = CONS_TABLES if tables is None else tables
    spec = LoadSpec("r", "t", tables[0], hit, N - hit, N, DIGEST, group_block_ids=tables)
    frame = codec.encode(payload, 512).to_bytearray()
    assert len(frame) < 4096  # a descriptor: no KV bytes in the frame
    with ArrivedFrameStream(frame) as stream:
        stream.authenticate(None)
        plan = plan_shared(stream.obj, local.layers, spec, p.reader, verify=True)
        plan.apply(stream, time.monotonic() + 5.0)
    return int(getattr(plan, "moved", -1))


def _expected(p: Producer, hit: int) -> dict[tuple[int, int], torch.Tensor]:
    """Consumer block -> the producer page it must hold: each layer's group blocks from
    the later of the local hit and the group's first kept block."""
    want = {}
    for layer in range(LAYERS):
        g = GROUP_OF[layer]
        kept = max(i + 1 for i, b in enumerate([0, *PROD_TABLES[g]]) if b == 0) - 1
        for k in range(max(hit // BS, kept), NEEDED):
            want[(layer, CONS_TABLES[g][k])] = p.page(layer, PROD_TABLES[g][k])
    return want


@pytest.mark.parametrize("hit", [0, 2 * BS, 5 * BS])
@pytest.mark.parametrize("digests", [True, False])
def test_each_group_gets_exactly_its_kept_blocks(
    producer: Producer, hit: int, digests: bool
) -> None:
    local = Local()
    payload = producer.payload(digests=digests)
    assert payload["block_ids"] == []
    groups = payload["metadata"]["shared"]["groups"]
    assert groups == [
        {"layers": [0, 2], "first": 4, "block_ids": [9, 10, 11]},
        {"layers": [1, 3], "first": 0, "block_ids": PROD_TABLES[1]},
    ]
    moved = _load(producer, local, payload, hit)
    want = _expected(producer, hit)
    got = local.written()
    assert got.keys() == want.keys()
    for k, page in want.items():
        assert torch.equal(got[k], page), k
    assert moved == len(want) * PAGE
    # 2 full layers x 7 blocks + 2 sliding layers x 3 blocks without a hit
    assert hit or len(want) == 2 * NEEDED + 2 * 3 == 20


@pytest.mark.parametrize("digests", [True, False])
def test_a_grouped_load_is_one_move_and_one_host_wait(producer: Producer, digests: bool) -> None:
    """Down the device branch (recording streams for the host): both groups in one plan,
    queued on one side stream after the forward's work, waited for once before the
    hold goes back."""
    local = Local()
    with device_order.installed("cpu", RecordingStreams()) as rs:
        assert isinstance(rs, RecordingStreams)
        moved = _load(producer, local, producer.payload(digests=digests))
    (side,) = [s for s in rs.side_streams() if s.ops]
    assert side.ops[0] == ("wait", ("forward", 0))
    assert len(rs.host_waits) == 1 and rs.waited_for((side.name, len(side.ops) - 1))
    # per layer one gather and one scatter (+ with digests one gather back and one download)
    assert len(rs.queued(side, "index_copy_")) == LAYERS
    assert len(rs.queued(side, "index_select")) == LAYERS * (2 if digests else 1)
    want = _expected(producer, 0)
    got = local.written()
    assert got.keys() == want.keys() and moved == len(want) * PAGE
    for k, page in want.items():
        assert torch.equal(got[k], page), k


def test_materialized_grouped_payload_holds_each_layers_kept_pages(producer: Producer) -> None:
    """The manager API's reader: a paged-blocks payload whose layers hold their group's
    pages from their first kept block."""
    got = materialize_pages(producer.payload(), producer.reader)
    assert got["metadata"]["layer_first_blocks"] == [4, 0, 4, 0]
    assert got["block_ids"] == list(range(NEEDED))
    for layer, pages in enumerate(got["layer_blocks"]["kv_blocks"]):
        table = PROD_TABLES[GROUP_OF[layer]]
        first = got["metadata"]["layer_first_blocks"][layer]
        assert pages.shape[0] == NEEDED - first
        for j, b in enumerate(table[first:]):
            assert torch.equal(pages[j].view(torch.uint8).reshape(-1), producer.page(layer, b))


class _Watched:
    """A page source whose hold's return records how many host waits came before it."""

    def __init__(self, inner: Any, rs: RecordingStreams) -> None:
        self.inner, self.rs = inner, rs
        self.waits_at_release: list[int] = []

    @contextlib.contextmanager
    def reading(self, hold: Any) -> Iterator[None]:
        with self.inner.reading(hold):
            yield
            self.waits_at_release.append(len(self.rs.host_waits))

    def attach(self, descriptor: Any) -> torch.Tensor:
        return self.inner.attach(descriptor)


def test_materialized_pages_are_gathered_before_the_hold_goes_back(producer: Producer) -> None:
    """On a device (the stream interface, recorded here on host tensors) the gathers of a
    materialized payload are waited for before the producer's hold is returned: the
    producer may reuse its blocks right after."""
    rs = RecordingStreams()
    source = _Watched(producer.reader, rs)
    with device_order.installed("cpu", rs):
        got = materialize_pages(producer.payload(), source)  # type: ignore[arg-type]
    assert source.waits_at_release == [1], source.waits_at_release
    assert len(got["layer_blocks"]["kv_blocks"]) == LAYERS


def test_a_consumer_keeping_more_blocks_than_sent_is_refused(producer: Producer) -> None:
    """A consumer whose sliding group keeps blocks 3..6 needs one the payload lacks."""
    local = Local()
    tables = [[0, 0, 0, 3, 5, 8, 9], CONS_TABLES[1]]
    with pytest.raises(KVPayloadError, match="different windows"):
        _load(producer, local, producer.payload(), 0, tables)
    assert local.written() == {}


def test_blocks_outside_the_producers_cache_are_refused(producer: Producer) -> None:
    local = Local()
    payload = producer.payload()
    payload["metadata"]["shared"]["groups"][0]["block_ids"][1] = NBLOCKS  # one past the end
    payload["metadata"]["shared"]["sums"] = None
    with pytest.raises(KVPayloadError, match="outside a cache"):
        _load(producer, local, payload)
    assert local.written() == {}


def _groups(w: dict[str, Any]) -> list[dict[str, Any]]:
    return w["metadata"]["shared"]["groups"]  # type: ignore[no-any-return]


SPOILS: dict[str, Callable[[dict[str, Any]], None]] = {
    "layer out of range": lambda w: _groups(w)[0]["layers"].append(LAYERS),
    "negative layer": lambda w: _groups(w)[0]["layers"].__setitem__(0, -1),
    "layer in two groups": lambda w: _groups(w)[1]["layers"].append(0),
    "layer in no group": lambda w: _groups(w)[1]["layers"].pop(),
    "bool layer": lambda w: _groups(w)[0]["layers"].__setitem__(0, False),
    "no layers": lambda w: _groups(w)[0].__setitem__("layers", []),
    "first past the end": lambda w: _groups(w)[0].__setitem__("first", NEEDED),
    "negative first": lambda w: _groups(w)[0].__setitem__("first", -1),
    "first not an int": lambda w: _groups(w)[0].__setitem__("first", "4"),
    "ids short of the tokens": lambda w: _groups(w)[0]["block_ids"].pop(),
    "ids beyond the tokens": lambda w: _groups(w)[1]["block_ids"].append(8),
    "negative id": lambda w: _groups(w)[1]["block_ids"].__setitem__(2, -3),
    "float id": lambda w: _groups(w)[1]["block_ids"].__setitem__(2, 3.0),
    "extra key": lambda w: _groups(w)[0].__setitem__("window", 64),
    "group not a mapping": lambda w: _groups(w).__setitem__(0, [0, 2]),
    "groups not a list": lambda w: w["metadata"]["shared"].__setitem__("groups", {}),
    "no groups": lambda w: w["metadata"]["shared"].__setitem__("groups", []),
    "more groups than layers": lambda w: _groups(w).extend([_groups(w)[0]] * LAYERS),
    "top-level ids too": lambda w: w.__setitem__("block_ids", [1, 2, 3, 4, 5, 6, 7]),
    "digest row of the full table on a sliding layer": lambda w: w["metadata"]["shared"][
        "sums"
    ].__setitem__(0, [1] * NEEDED),
    "digest rows missing": lambda w: w["metadata"]["shared"]["sums"].pop(),
    "rows beyond the tokens": lambda w: w["metadata"].__setitem__("rows", (NEEDED + 1) * BS),
}


@pytest.mark.parametrize("what", list(SPOILS))
def test_malformed_groups_are_refused(producer: Producer, what: str) -> None:
    good = producer.payload()
    producer.region.release(good["metadata"]["shared"]["hold"])
    shared_fields(good)  # the unspoiled payload passes
    bad = copy.deepcopy(good)
    SPOILS[what](bad)
    with pytest.raises(KVPayloadError, match="shared-pages payload"):
        shared_fields(bad)
    local = Local()
    with pytest.raises(KVPayloadError):
        plan_shared(
            bad,
            local.layers,
            LoadSpec("r", "t", CONS_TABLES[0], 0, N, N, DIGEST, group_block_ids=CONS_TABLES),
            producer.reader,
            verify=True,
        )
    assert local.written() == {}
