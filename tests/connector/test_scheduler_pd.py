"""P/D through vLLM's real scheduler and the real connector halves, without engines
(:mod:`sched_harness`): the scheduler-level cases, each in well under a second.

The reference is the producer's own cache: after a load, every token the consumer did
not hold must carry exactly the producer's K and V.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from _kv_fixtures import NBLOCKS  # noqa: E402
from sched_harness import RUNNERS, Engine, abort_while_loading, decode, prefill  # noqa: E402

PROMPT = [(i * 7919) % 2003 + 1 for i in range(200)]


@pytest.fixture(
    scope="module",
    params=[(mode, runner) for runner in RUNNERS for mode in ("packed", "one_copy")],
    ids=lambda p: "-".join(p),
)
def pair(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    ns = f"sched-{uuid.uuid4().hex[:8]}"
    mode, runner = request.param
    share = {"backend_extra": {"namespace": ns, "share_cache": mode == "one_copy"}}
    prod = Engine(tiny_model_dir, "kv_producer", ns, seed=1, runner=runner, **share)
    cons = Engine(tiny_model_dir, "kv_consumer", ns, seed=2, runner=runner, **share)
    try:
        yield prod, cons
    finally:
        cons.close()
        prod.close()


def _same_kv(prod: Engine, cons: Engine, rid: str, start: int, end: int) -> None:
    for got, want in zip(cons.kv(rid, start, end), prod.kv(rid, start, end), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 100])
def test_a_prompt_of_any_length_is_loaded_whole(pair: tuple[Engine, Engine], n: int) -> None:
    prod, cons = pair
    rid = f"short-{n}-{uuid.uuid4().hex[:6]}"
    prompt = [n + 3, *PROMPT[: n - 1]]  # its own first token: no prefix hit anywhere
    load = decode(prod, cons, rid, prompt, prefill(prod, rid, prompt))
    assert load["ok"] is True and load["tokens"] == n and not load.get("local_hit"), load
    _same_kv(prod, cons, rid, 0, n)


def test_a_local_prefix_hit_loads_the_tokens_after_it(pair: tuple[Engine, Engine]) -> None:
    prod, cons = pair
    prompt = [2001, *PROMPT[:99]]  # 100 tokens: vLLM's local hit is 3 full blocks (96)
    first = f"prefix-a-{uuid.uuid4().hex[:6]}"
    assert decode(prod, cons, first, prompt, prefill(prod, first, prompt))["ok"]
    again = f"prefix-b-{uuid.uuid4().hex[:6]}"
    load = decode(prod, cons, again, prompt, prefill(prod, again, prompt))
    assert load["ok"] is True and load["tokens"] == 100 - 96, load
    assert cons.blocks[again][:3] == cons.blocks[first][:3]  # the local hit, reused
    _same_kv(prod, cons, again, 96, 100)


def test_an_abort_while_loading_frees_both_sides(pair: tuple[Engine, Engine]) -> None:
    prod, cons = pair
    rid = f"abort-{uuid.uuid4().hex[:6]}"
    abort_while_loading(prod, cons, rid, [2002, *PROMPT[:149]], NBLOCKS)
