"""vLLM's sleep mode on a real shared-memory cache region (no engine).

A producer's cache is exported, a payload names generation 0; the producer sleeps
(its memory is then overwritten, as sleep discards it) and wakes as generation 2. A
consumer must refuse the old payload before any byte moves, both through a mapping it
kept from before the sleep and through a new one, and copy a payload of the new
generation exactly (reference: pages regenerated from their seeds). A hold a reader
copies under when the producer sleeps fails that copy; a consumer's sleep unmaps the
producers' caches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.cache_region import ShmCacheRegion
from vllm_omni_kv.backends.shm.producer import ProducerArena
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import infer_identity
from vllm_omni_kv.kvcache.shared_pages import layer_geometry

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 80, 2, 16, 64  # 1.3 MB: a region allocation
PAIRS = [(5, 0), (6, 1), (12, 2)]  # (producer page, consumer page)


def _reference(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, HEADS, BS, 2 * DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


class Pair:
    """A producer region holding a vLLM-shaped cache, and a consumer region."""

    def __init__(self, ns: str) -> None:
        self.pa, self.ca = ProducerArena(0, namespace=ns), ProducerArena(0, namespace=ns)
        self.prod = ShmCacheRegion(ns, self.pa, arena.STALE_S)
        self.cons = ShmCacheRegion(ns, self.ca, arena.STALE_S)
        per_layer = BLOCKS * HEADS * BS * 2 * DIM * 2  # bf16
        with self.prod.allocation_context():
            buf = torch.zeros(LAYERS * per_layer, dtype=torch.int8)
        self.caches = [
            buf[i * per_layer : (i + 1) * per_layer]
            .view(torch.bfloat16)
            # as vLLM's CPU layout: [blocks, heads, block size, K and V]
            .view(BLOCKS, HEADS, BS, 2 * DIM)
            for i in range(LAYERS)
        ]
        self.ident = infer_identity(self.caches[0], packing="k_v")
        self.mine = [torch.zeros_like(c) for c in self.caches]  # the consumer's cache

    def write(self, seed: int) -> None:
        for c, ref in zip(self.caches, _reference(seed), strict=True):
            c.copy_(ref)

    def export(self) -> tuple[dict[str, Any], Any]:
        got = self.prod.export(self.caches)
        assert got is not None
        desc, base, nbytes = got
        return desc, layer_geometry(self.caches, base, nbytes)

    def copy(self, desc: dict[str, Any], geometry: Any, hold: str) -> int:
        with self.cons.reading(hold):
            return self.cons.copy_into(desc, geometry, self.ident, self.mine, PAIRS, None, 0)

    def holds(self, seed: int) -> bool:
        """Whether the consumer's pages are exactly the producer's pages of ``seed``."""
        ref = _reference(seed)
        return all(torch.equal(self.mine[i][d], ref[i][s]) for i in range(LAYERS) for s, d in PAIRS)

    def untouched(self) -> bool:
        return not any(m.any() for m in self.mine)

    def close(self) -> None:
        self.cons.close()
        self.prod.close()
        self.ca.close()
        self.pa.close()


@pytest.fixture
def pair(ns: str) -> Iterator[Pair]:
    p = Pair(ns)
    yield p
    p.close()


def _mapped(name: str) -> int:
    """How many mappings of ``/dev/shm`` file ``name`` this process holds."""
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(arena.path(name)) for line in f)


def test_an_older_generation_is_refused_before_any_byte_moves(pair: Pair, ns: str) -> None:
    pair.write(seed=1)
    desc0, geometry = pair.export()
    assert desc0["generation"] == 0
    hold0 = pair.prod.hold("p", "d", "before")
    pair.prod.sleep()
    assert pair.prod.generation == 1 and pair.prod.asleep
    assert pair.prod.released(hold0), "sleep left a hold on the cache's blocks"
    for c in pair.caches:  # what vLLM's sleep leaves in the memory: anything
        c.fill_(float("nan"))
    late = pair.prod.hold("p", "d", "while-asleep")  # a hold made by mistake meanwhile
    with pytest.raises(KVTransferError, match="generation 0.*asleep"):
        pair.copy(desc0, geometry, late)
    assert pair.untouched()
    pair.prod.wake()
    pair.prod.wake()  # idempotent, as is sleep
    pair.prod.sleep()
    pair.prod.wake()
    assert pair.prod.generation == 4 and not pair.prod.asleep
    pair.write(seed=2)  # the engine computes again after waking
    desc4, geometry4 = pair.export()
    assert desc4["generation"] == 4 and geometry4 == geometry
    for name in ("old-a", "old-b"):  # a fresh mapping, then the one kept from the first
        with pytest.raises(KVTransferError, match="generation 0.*generation 4"):
            pair.copy(desc0, geometry, pair.prod.hold("p", "d", name))
        assert pair.untouched()
    moved = pair.copy(desc4, geometry4, pair.prod.hold("p", "d", "after"))
    assert moved == LAYERS * len(PAIRS) * HEADS * BS * 2 * DIM * 2
    assert pair.holds(seed=2)
    pair.prod.sleep()  # a mapping kept across the producer's sleep refuses too
    with pytest.raises(KVTransferError, match="generation 4.*asleep"):
        pair.copy(desc4, geometry4, pair.prod.hold("p", "d", "kept"))


def test_sleep_fails_a_copy_running_under_a_hold(pair: Pair) -> None:
    pair.write(seed=3)
    desc, geometry = pair.export()
    hold = pair.prod.hold("p", "d", "busy")
    with pytest.raises(KVTransferError, match="put to sleep"):
        with pair.cons.reading(hold):  # the consumer holds the blocks ...
            pair.cons.copy_into(desc, geometry, pair.ident, pair.mine, PAIRS, None, 0)
            pair.prod.sleep()  # ... when the producer's cache goes to sleep
    assert pair.prod.released(hold)


def test_a_consumers_sleep_unmaps_the_producers_cache(pair: Pair) -> None:
    pair.write(seed=4)
    desc, geometry = pair.export()
    seg = desc["name"]
    assert _mapped(seg) == 1  # the producer's own mapping
    pair.copy(desc, geometry, pair.prod.hold("p", "d", "one"))
    assert _mapped(seg) == 2
    pair.cons.sleep()
    assert _mapped(seg) == 1
    pair.cons.wake()
    pair.mine[0].zero_()
    pair.mine[1].zero_()
    pair.copy(desc, geometry, pair.prod.hold("p", "d", "two"))  # mapped again on demand
    assert pair.holds(seed=4)


def test_kept_views_never_outlive_the_mapping_or_generation_they_were_made_for(ns: str) -> None:
    """The consumer keeps the producer's page views per mapping and geometry across moves.
    A restarted producer (a new cache segment, the same geometry) is copied from through
    views of its own mapping, never through those of the one before; a mapping kept
    across a sleep still refuses the old generation, and copies the new one exactly."""
    first = Pair(ns)
    first.write(seed=5)
    desc, geometry = first.export()
    first.copy(desc, geometry, first.prod.hold("p", "d", "a"))
    assert first.holds(seed=5)
    first.prod.sleep()
    first.prod.wake()
    first.write(seed=7)
    with pytest.raises(KVTransferError, match="generation 0.*generation 2"):
        first.copy(desc, geometry, first.prod.hold("p", "d", "old"))
    desc2, _ = first.export()
    first.copy(desc2, geometry, first.prod.hold("p", "d", "new"))
    assert first.holds(seed=7)
    second = Pair(ns)  # the restarted producer; first.cons stays the consumer
    try:
        second.write(seed=6)
        desc3, geometry3 = second.export()
        assert geometry3 == geometry and desc3["name"] != desc["name"]
        first.prod.close()
        first.pa.close()  # the first producer's segment is gone
        for m in first.mine:
            m.zero_()
        first.copy(desc3, [list(g) for g in geometry3], second.prod.hold("p", "d", "b"))
        assert first.holds(seed=6), "a move read the previous producer's pages"
    finally:
        second.close()
        first.close()


def test_a_kept_geometry_matches_only_exact_ints(pair: Pair) -> None:
    """A payload's geometry equal in value to one the consumer keeps views for, but with a
    float or a bool for an int, is refused as before any views were kept."""
    pair.write(seed=8)
    desc, geometry = pair.export()
    pair.copy(desc, geometry, pair.prod.hold("p", "d", "a"))  # its views are kept now
    forged = [
        [[float(g[0]), g[1], g[2]] for g in geometry],
        [[g[0], g[1], [*g[2][:3], True if g[2][3] == 1 else float(g[2][3])]] for g in geometry],
    ]
    for bad in forged:
        assert bad == geometry
        with pytest.raises(KVPayloadError, match="geometry"):
            pair.copy(desc, bad, pair.prod.hold("p", "d", f"forged{forged.index(bad)}"))
    pair.copy(desc, [list(g) for g in geometry], pair.prod.hold("p", "d", "b"))
    assert pair.holds(seed=8)
