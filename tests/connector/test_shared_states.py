"""One copy for a model with recurrent-state layers: a shared-pages payload naming the
attention pages and each state layer's page, from a producer cache in a real ``/dev/shm``
segment (real holds) into a consumer cache with guard bytes, through the wire codec.

The model is Qwen3-Next-shaped, laid out as vLLM 0.32 allocates a hybrid cache: one
tensor of ``NBLOCKS`` pages shared by every layer (one full-attention layer in group 2,
two gated-delta-net layers in groups 0 and 1, each state page padded to the attention
page), block ids disjoint across groups. Expected bytes come from indexing the producer's
tensor by its tables; every other consumer byte (other blocks, a state page's padding,
the guards) must stay as it was.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _kv_fixtures import ShmRegions, shm_namespace

from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.kv_groups import plan_shared
from vllm_omni_kv.connector.metadata import LoadSpec, SaveSpec
from vllm_omni_kv.connector.page_export import PageExport
from vllm_omni_kv.connector.receive import LayerCache, layer_caches
from vllm_omni_kv.connector.state_layers import StateLayer, state_targets
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.state_pages import StateLayoutId, state_pages
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import ArrivedFrameStream

HEADS, BS, DIM, NBLOCKS = 2, 16, 8, 16
PAGE = HEADS * BS * 2 * DIM * 2  # one attention block, bfloat16: also the state block
IDENT = StateLayoutId(((3, 48), (1, 8, 8)), ("float32", "float32"), "GDN_ATTN", "SD")
C = IDENT.content_bytes  # 832 of the 1024-byte page: the rest is padding
N, NEEDED = 100, 7  # payload tokens (the prompt's N - 1), blocks
DIGEST = "dg"
ENGINE = EngineLayout(BS, "LBHNC", "CPU_ATTN")
#: per group (two state groups first, as vLLM orders Qwen3-Next's, then attention):
#: "align" mode keeps the state after N tokens in table slot (N - 1) // BS
PROD = [[0] * 6 + [3], [0] * 6 + [5], [1, 2, 4, 6, 7, 8, 9]]
CONS = [[0] * 6 + [9], [0] * 6 + [11], [2, 4, 6, 8, 10, 12, 13]]
GUARD = 4096


def _layers(raw: torch.Tensor, ident: StateLayoutId = IDENT) -> tuple[LayerCache, list[Any]]:
    """vLLM's views of one hybrid cache tensor: the attention layer and two state layers."""
    attn = raw.view(torch.bfloat16).view(NBLOCKS, HEADS, BS, 2 * DIM)
    (layer,) = layer_caches({"attn": attn}, ENGINE)
    layer.group = 2
    states = [
        StateLayer(
            f"gdn{g}",
            state_pages(raw.view(torch.int8).view(NBLOCKS, 1, 1, PAGE), ident),
            ident,
            BS,
            g,
        )  # fmt: skip
        for g in (0, 1)
    ]
    return layer, states


class Producer(ShmRegions):
    """The hybrid cache in a real shm cache segment, exported, and a consumer's reader."""

    def __init__(self, ns: str) -> None:
        super().__init__(ns, NBLOCKS * PAGE, seed=5)
        self.raw = self.cache
        layer, self.states = _layers(self.raw)
        self.layers = [layer]
        export = PageExport.create(self.region, self.layers, "shm", self.states)
        assert export is not None
        self.export = export

    def payload(self, digests: bool = True) -> Any:
        """The payload of a new request (its own hold), as a decoded dict."""
        hold = self.region.hold("prefill", "decode", uuid.uuid4().hex[:8])
        spec = SaveSpec("r", "t", PROD[0], N, DIGEST, group_block_ids=PROD)
        self.region.digests = digests
        return self.export.payload(spec, self.layers, hold, {"prompt_digest": DIGEST}).to_dict()

    def block(self, b: int) -> torch.Tensor:
        return self.raw.view(NBLOCKS, PAGE)[b].clone()


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    with shm_namespace("ss") as ns:
        p = Producer(ns)
        yield p
        p.close()


class Local:
    """The consumer's hybrid cache tensor between guard bytes of a known pattern."""

    def __init__(self, ident: StateLayoutId = IDENT) -> None:
        self.buf = torch.full((2 * GUARD + NBLOCKS * PAGE,), 0x5A, dtype=torch.uint8)
        self.raw = self.buf[GUARD : GUARD + NBLOCKS * PAGE]
        layer, self.states = _layers(self.raw, ident)
        self.layers = [layer]
        self.before = self.buf.clone()

    def written(self) -> dict[int, torch.Tensor]:
        """``block -> bytes`` of every block that changed; the guards must not."""
        assert torch.equal(self.buf[:GUARD], self.before[:GUARD])
        assert torch.equal(self.buf[-GUARD:], self.before[-GUARD:])
        now, was = self.raw.view(NBLOCKS, PAGE), self.before[GUARD:-GUARD].view(NBLOCKS, PAGE)
        return {b: now[b].clone() for b in range(NBLOCKS) if not torch.equal(now[b], was[b])}


def _load(p: Producer, local: Local, payload: Any, hit: int = 0) -> int:
    """What the consumer runs on the received frame; bytes the copy moved."""
    spec = LoadSpec("r", "t", CONS[0], hit, N - hit, N, DIGEST, group_block_ids=CONS)
    frame = codec.encode(payload, 512).to_bytearray()
    assert len(frame) < 4096  # a descriptor: no KV bytes in the frame
    with ArrivedFrameStream(frame) as stream:
        stream.authenticate(None)
        targets = state_targets(local.states, spec)
        plan = plan_shared(stream.obj, local.layers, spec, p.reader, True, targets)
        plan.apply(stream, time.monotonic() + 5.0)
    return int(getattr(plan, "moved", -1))


@pytest.mark.parametrize("hit", [0, 2 * BS])
@pytest.mark.parametrize("digests", [True, False])
def test_attention_and_state_pages_arrive_and_nothing_else_changes(
    producer: Producer, hit: int, digests: bool
) -> None:
    local = Local()
    payload = producer.payload(digests=digests)
    hold = payload["metadata"]["shared"]["hold"]
    moved = _load(producer, local, payload, hit)
    assert producer.region.released(hold)  # the producer's blocks may go
    got = local.written()
    attn = {CONS[2][k]: PROD[2][k] for k in range(hit // BS, NEEDED)}
    assert got.keys() == {*attn, CONS[0][-1], CONS[1][-1]}
    for dst, src in attn.items():
        assert torch.equal(got[dst], producer.block(src)), dst
    for g in (0, 1):  # the state's bytes; the padding after them untouched
        page = got[CONS[g][-1]]
        assert torch.equal(page[:C], producer.block(PROD[g][-1])[:C]), g
        assert bool((page[C:] == 0x5A).all()), g
    assert moved == len(attn) * PAGE + 2 * C


def test_a_different_state_identity_is_refused_before_a_byte_moves(producer: Producer) -> None:
    """The same bytes per page, another conv state layout: vLLM would misread them."""
    local = Local(StateLayoutId(IDENT.shapes, IDENT.dtypes, IDENT.kind, "DS"))
    payload = producer.payload()
    with pytest.raises(KVPayloadError, match="conv layout DS"):
        _load(producer, local, payload)
    producer.region.release(payload["metadata"]["shared"]["hold"])
    assert local.written() == {}


def test_a_payload_and_a_model_that_disagree_on_state_are_refused(producer: Producer) -> None:
    payload = producer.payload()
    producer.region.release(payload["metadata"]["shared"]["hold"])
    stateless = copy.deepcopy(payload)
    del stateless["metadata"]["shared"]["states"]
    local = Local()
    with pytest.raises(KVPayloadError, match="carries no recurrent state"):
        _load(producer, local, stateless)
    local.states = []  # an attention-only model
    with pytest.raises(KVPayloadError, match="does not keep"):
        _load(producer, local, payload)
    assert local.written() == {}


def _states(w: dict[str, Any]) -> dict[str, Any]:
    return w["metadata"]["shared"]["states"]  # type: ignore[no-any-return]


#: spoiled fields found before anything is copied
SPOILS: dict[str, Callable[[dict[str, Any]], None]] = {
    "states not a mapping": lambda w: w["metadata"]["shared"].__setitem__("states", [1]),
    "geometry for one layer": lambda w: _states(w)["geometry"].pop(),
    "geometry not a list": lambda w: _states(w)["geometry"].__setitem__(0, "x"),
    "a state wider than the model's": lambda w: _states(w)["geometry"][0][1].__setitem__(3, C + 8),
    "negative stride": lambda w: _states(w)["geometry"][0][2].__setitem__(0, -PAGE),
    "block past the producer's cache": lambda w: _states(w)["blocks"].__setitem__(0, NBLOCKS),
    "negative block": lambda w: _states(w)["blocks"].__setitem__(1, -1),
    "bool block": lambda w: _states(w)["blocks"].__setitem__(0, True),
    "string block": lambda w: _states(w)["blocks"].__setitem__(0, "3"),
    "blocks missing": lambda w: _states(w).pop("blocks"),
    "digests for one layer": lambda w: _states(w)["sums"].pop(),
    "no state layouts": lambda w: w["metadata"].pop("state_layouts"),
    "another state kind": lambda w: w["metadata"]["state_layouts"]["1"].__setitem__(
        "kind", "MAMBA2"
    ),
    "a layout under the attention layer's index": lambda w: w["metadata"].__setitem__(
        "state_layouts", {"0": IDENT.to_dict(), "1": IDENT.to_dict()}
    ),
}


@pytest.mark.parametrize("what", list(SPOILS))
def test_malformed_state_fields_are_refused_before_a_byte_moves(
    producer: Producer, what: str
) -> None:
    good = producer.payload()
    producer.region.release(good["metadata"]["shared"]["hold"])
    bad = copy.deepcopy(good)
    SPOILS[what](bad)
    local = Local()
    with pytest.raises(KVPayloadError):
        _load(producer, local, bad)
    assert local.written() == {}


def test_a_state_geometry_outside_the_producers_region_is_refused(producer: Producer) -> None:
    """Found when the region is mapped (its size is the producer's): nothing is read."""
    bad = producer.payload()
    _states(bad)["geometry"][1][0] = 1 << 40
    with pytest.raises(KVPayloadError, match="outside"):
        _load(producer, Local(), bad)


def test_a_state_page_rewritten_after_publishing_fails_its_digest(producer: Producer) -> None:
    payload = producer.payload(digests=True)
    state = producer.raw.view(NBLOCKS, PAGE)[PROD[1][-1]]
    saved = state.clone()
    try:
        state[7] ^= 0xFF
        with pytest.raises(KVPayloadError, match="digest"):
            _load(producer, Local(), payload)
    finally:
        state.copy_(saved)
