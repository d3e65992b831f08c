"""P/D of a hybrid model under vLLM's hybrid KV cache manager, without engines
(:mod:`sched_harness` with ``hybrid=True``: a tiny Gemma 3-shaped cache, a sliding
window of 64 tokens on KV cache group 0 and full attention on group 1, blocks of 32).

The references: the producer's own cache for the bytes, and vLLM's sliding-window rule
for what each group keeps: after ``n`` computed tokens a window of ``w`` tokens skips
the first ``n - w + 1`` tokens, so the group keeps blocks from ``(n - w + 1) // 32`` on
and only those cross the transport.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from _kv_fixtures import BS, DIM, HEADS  # noqa: E402
from sched_harness import (  # noqa: E402
    FULL,
    HYBRID_BLOCKS,
    RUNNERS,
    SLIDING,
    WINDOW,
    Engine,
    abort_while_loading,
    decode,
    prefill,
)
from vllm.v1.engine import FinishReason  # noqa: E402

from vllm_omni_kv.backends.shm.inventory import inventory  # noqa: E402

N = 300  # tokens of the long prompt: 10 blocks, the window's 3 of them
PAGE = HEADS * BS * 2 * DIM * 2  # bytes of one block of one bf16 layer
SLIDE, FULLG = 0, 1  # the KV cache groups


def kept_from(n: int) -> int:
    """The first block a sliding-window group keeps after ``n`` computed tokens."""
    return max(0, n - WINDOW + 1) // BS


def blocks(n: int) -> int:
    return -(-n // BS)


def pages(load: dict) -> int:
    """KV pages a load moved: its bytes are whole pages plus the frame's metadata (under
    one page)."""
    n, rest = divmod(int(load["bytes"]), PAGE)
    assert 0 < rest < 4096, load  # the header: present, and far smaller than a page
    return n


@pytest.fixture(
    scope="module",
    params=[(mode, runner) for runner in RUNNERS for mode in ("packed", "one_copy")],
    ids=lambda p: "-".join(p),
)
def pair(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """A producer and a consumer; ``one_copy``: the shm region is on (shared-pages
    payloads with one block list per group), else packed payloads."""
    ns = f"hma-{uuid.uuid4().hex[:8]}"
    mode, runner = request.param
    share = {"backend_extra": {"namespace": ns, "share_cache": mode == "one_copy"}}
    prod = Engine(tiny_model_dir, "kv_producer", ns, seed=1, hybrid=True, runner=runner, **share)
    cons = Engine(tiny_model_dir, "kv_consumer", ns, seed=2, hybrid=True, runner=runner, **share)
    try:
        yield prod, cons
    finally:
        cons.close()
        prod.close()


def _extra(engine: Engine) -> dict:
    return engine.config.kv_transfer_config.kv_connector_extra_config["backend_extra"]


def _namespace(engine: Engine) -> str:
    return str(_extra(engine)["namespace"])


def _one_copy(engine: Engine) -> bool:
    return bool(_extra(engine)["share_cache"])


def _prompt(tag: int, n: int = N) -> list[int]:
    return [tag, *((i * 7919) % 2003 + 1 for i in range(n - 1))]  # its own first token


def _same_kv(prod: Engine, cons: Engine, rid: str, group: int, start: int, end: int) -> None:
    got, want = cons.kv(rid, start, end, group), prod.kv(rid, start, end, group)
    assert len(got) == len(want) == 4  # K and V of the group's two layers
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _null_pages(engine: Engine) -> list[torch.Tensor]:
    return [cache[0].clone() for cache in engine.caches.values()]


def test_each_group_gets_the_blocks_it_keeps(pair: tuple[Engine, Engine]) -> None:
    prod, cons = pair
    rid = f"long-{uuid.uuid4().hex[:6]}"
    prompt = _prompt(2001)
    null_before = _null_pages(cons)
    params = prefill(prod, rid, prompt)
    # one copy publishes a shared-pages payload under a hold on the producer's blocks
    assert inventory(_namespace(prod)).holds == (1 if _one_copy(prod) else 0)
    first = kept_from(N)
    assert first == 7
    # remote_block_ids per group: the blocks each group of the producer keeps
    assert params["remote_block_ids"] == [
        prod.tables[rid][SLIDE][first : blocks(N)],
        prod.tables[rid][FULLG][: blocks(N)],
    ]
    load = decode(prod, cons, rid, prompt, params)
    assert load["ok"] is True and load["tokens"] == N, load
    # vLLM's consumer table: the null block before the window, its own blocks in it
    table = cons.tables[rid][SLIDE]
    assert table[:first] == [0] * first and 0 not in table[first : blocks(N)]
    _same_kv(prod, cons, rid, FULLG, 0, N)
    _same_kv(prod, cons, rid, SLIDE, first * BS, N)
    # 26 pages where a single table (HMA off) moves 40
    assert pages(load) == len(FULL) * blocks(N) + len(SLIDING) * (blocks(N) - first) == 26
    for got, want in zip(_null_pages(cons), null_before, strict=True):
        assert torch.equal(got, want)  # nothing was written into the null block


def test_a_local_prefix_hit_loads_each_group_after_it(pair: tuple[Engine, Engine]) -> None:
    prod, cons = pair
    prompt = _prompt(2002)
    first = f"prefix-a-{uuid.uuid4().hex[:6]}"
    assert decode(prod, cons, first, prompt, prefill(prod, first, prompt))["ok"]
    again = f"prefix-b-{uuid.uuid4().hex[:6]}"
    load = decode(prod, cons, again, prompt, prefill(prod, again, prompt))
    hit = (N - 1) // BS * BS  # vLLM's local hit: every full block but the last token's
    assert load["ok"] is True and load["tokens"] == N - hit, load
    a, b = cons.tables[first], cons.tables[again]
    assert b[FULLG][: hit // BS] == a[FULLG][: hit // BS]  # the hit, reused
    window = slice(kept_from(N), hit // BS)
    assert b[SLIDE][window] == a[SLIDE][window]
    _same_kv(prod, cons, again, FULLG, hit, N)
    _same_kv(prod, cons, again, SLIDE, kept_from(N) * BS, N)
    assert pages(load) == (len(FULL) + len(SLIDING)) * (blocks(N) - hit // BS)


def test_a_refused_payload_fails_the_request_not_the_scheduler(
    pair: tuple[Engine, Engine],
) -> None:
    """A failed load of a model with several groups is reported in failed_recving (vLLM
    maps no block ids to requests there): vLLM fails the request and keeps going."""
    prod, cons = pair
    rid = f"refused-{uuid.uuid4().hex[:6]}"
    params = prefill(prod, rid, _prompt(2003))
    other = _prompt(2004)  # not the prompt the producer prefilled
    cons.add(rid, other, dict(params))
    cons.run_until(lambda: rid in cons.finished)
    prod.run_until(lambda: rid in prod.sent)  # the refused payload is released
    assert cons.reasons[rid] == FinishReason.ERROR  # kv_load_failure_policy "fail"
    assert cons.sched.requests.get(rid) is None
    pool = cons.sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == HYBRID_BLOCKS - 1


def test_an_abort_while_loading_frees_both_sides(pair: tuple[Engine, Engine]) -> None:
    prod, cons = pair
    rid = f"abort-{uuid.uuid4().hex[:6]}"
    abort_while_loading(prod, cons, rid, _prompt(2005, 150), HYBRID_BLOCKS)
