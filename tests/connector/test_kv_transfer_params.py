"""``kv_transfer_params`` in vLLM's shapes, through vLLM's real scheduler
(:mod:`sched_harness`, no engines): the producer's ``remote_block_ids`` is one list per KV
cache group, as vLLM's own connectors give it (NixlConnector in vLLM 0.33; vLLM's
connector unit tests index ``remote_block_ids[0]``), and a consumer still loads from the
flat list that this package's producers gave with vLLM 0.32.

The reference for the block ids is vLLM's ``KVCacheManager``: each request's block table
as the scheduler allocated it, and the prefix-cache hit it counted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from _kv_fixtures import BS, NBLOCKS  # noqa: E402
from sched_harness import RUNNERS, Engine, decode, prefill  # noqa: E402

PROMPT = [(i * 4013) % 1999 + 1 for i in range(4 * BS)]


@pytest.fixture(scope="module", params=RUNNERS)
def pair(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    ns = f"params-{uuid.uuid4().hex[:8]}"
    prod = Engine(tiny_model_dir, "kv_producer", ns, seed=1, runner=request.param)
    cons = Engine(tiny_model_dir, "kv_consumer", ns, seed=2, runner=request.param)
    try:
        yield prod, cons
    finally:
        cons.close()
        prod.close()


def test_a_prefix_hit_still_sends_every_block_one_list_per_group(
    pair: tuple[Engine, Engine],
) -> None:
    """vLLM's remote-decode prefix-cache lifecycle: a request 3.5 blocks long primes the
    prefix cache; a remote-decode request of its first 2.5 blocks hits 2 of them and
    returns all 3 blocks (the partial one included) as group 0's list; once a consumer
    has read them and the worker reported the send finished, the scheduler holds nothing."""
    prod, cons = pair
    first = 3000 + len(prod.finished)  # a first token of its own: no hit from other tests
    prime = f"prime-{uuid.uuid4().hex[:6]}"
    prod.add(prime, [first, *PROMPT[: int(3.5 * BS) - 1]], {})
    prod.run_until(lambda: prime in prod.finished)
    assert prod.finished[prime] is None  # a local request: no kv_transfer_params

    rid = f"remote-{uuid.uuid4().hex[:6]}"
    prompt = [first, *PROMPT[: int(2.5 * BS) - 1]]
    prod.add(rid, prompt, {"do_remote_decode": True})
    scheduled = prod.step().num_scheduled_tokens[rid]
    assert scheduled == BS // 2  # vLLM computes only the tokens after its 2-block hit
    prod.run_until(lambda: rid in prod.finished)
    params = prod.finished[rid]
    assert params is not None
    table = prod.tables[rid][0]  # the KV cache manager's block table of the request
    assert params["remote_block_ids"] == [table[:3]]
    assert len(params["remote_block_ids"][0]) == 3
    assert table[:2] == prod.tables[prime][0][:2]  # the cached blocks, shared

    assert decode(prod, cons, rid, prompt, params)["ok"]  # a consumer reads the payload
    assert not prod.sched.requests
    assert prod.sched.kv_cache_manager.block_pool.get_num_free_blocks() == NBLOCKS - 1


@pytest.mark.parametrize("shape", ["per_group", "flat"])
def test_a_consumer_loads_from_either_shape(pair: tuple[Engine, Engine], shape: str) -> None:
    """The params a producer returns, as they are (one list per group) or with
    ``remote_block_ids`` flattened as a vLLM 0.32-era producer sent it: the consumer loads
    every token, and its blocks hold exactly the producer's K and V."""
    prod, cons = pair
    rid = f"{shape}-{uuid.uuid4().hex[:6]}"
    prompt = [3100 + len(prod.finished), *PROMPT[: 2 * BS + 4]]
    params = prefill(prod, rid, prompt)
    assert len(params["remote_block_ids"]) == 1  # one KV cache group
    if shape == "flat":
        params = {**params, "remote_block_ids": list(params["remote_block_ids"][0])}
    load = decode(prod, cons, rid, prompt, params)
    assert load["ok"] is True and load["tokens"] == len(prompt), load
    for got, want in zip(cons.kv(rid, 0, len(prompt)), prod.kv(rid, 0, len(prompt)), strict=True):
        assert torch.equal(got, want)
