"""P/D of a hybrid model with vLLM's hybrid KV cache manager on: a tiny random Gemma 3
(``tests/_models.tiny_gemma3``: a 64-token sliding window on layers 0-2, full attention
on layer 3, float32, blocks of 32) between two in-process engines over shared memory.

Asserted: the consumer decodes the producer's own greedy tokens for every prompt; each
load moves whole pages for every block of the full-attention layer and only the window's
blocks of each sliding layer (vLLM's rule: after ``n`` tokens a window of ``w`` keeps
blocks from ``(n - w + 1) // 32``); ``remote_block_ids`` holds one list per KV cache
group; a prompt cached on the consumer loads only the blocks after its local hit. The
payloads are shm's default, one copy: each prefill leaves a hold on the producer's blocks
(a shared-pages payload; a packed one holds none), a load moves exactly its pages plus a
descriptor under 4 KiB, and the producer never logs a fallback to packed payloads. A
request aborted while its load waits is cancelled at once and gives back every block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from _models import GEMMA3_LAYERS, GEMMA3_WINDOW, tiny_gemma3  # noqa: E402
from pd_helpers import (  # noqa: E402
    LOG_DIR,
    NAMESPACE,
    EngineProc,
    assert_abort_while_loading_frees_every_block,
    engine_cfg,
    engines,
    long_prompt,
    make_prompts,
    omni_ktc,
)

from vllm_omni_kv.backends.shm.inventory import inventory  # noqa: E402

BS = 32
PAGE = 2 * BS * 2 * 64 * 4  # one block of one layer: 2 KV heads of 64, K and V, float32
SLIDING = GEMMA3_LAYERS.count("sliding_attention")
FULL = GEMMA3_LAYERS.count("full_attention")
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


def _blocks(n: int) -> int:
    return -(-n // BS)


def _window_start(n: int) -> int:
    """The first block a sliding layer keeps after ``n`` tokens."""
    return max(0, n - GEMMA3_WINDOW + 1) // BS


def _pages(n: int, local: int = 0) -> int:
    """Pages a load of tokens ``[local, n)`` moves: every full layer from the local hit,
    every sliding layer from the later of the hit and its window."""
    full = _blocks(n) - local // BS
    sliding = _blocks(n) - max(local // BS, _window_start(n))
    return FULL * full + SLIDING * sliding


@pytest.fixture(scope="module")
def gemma() -> Path:
    return tiny_gemma3()


@pytest.fixture(scope="module")
def pair(gemma: Path) -> Iterator[tuple[EngineProc, EngineProc]]:
    with engines(
        ("hybrid-producer", engine_cfg(gemma, omni_ktc("kv_producer"))),
        ("hybrid-consumer", engine_cfg(gemma, omni_ktc("kv_consumer"))),
    ) as (prod, cons):
        yield prod, cons


def _prefill(prod: EngineProc, prompts: list[list[int]]) -> list[dict[str, Any]]:
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[REMOTE_DECODE] * len(prompts))
    assert "error" not in r, r
    return [o["kv_transfer_params"] for o in r["outputs"]]


def _decode(
    prod: EngineProc, cons: EngineProc, prompts: list[list[int]]
) -> list[tuple[list[int], dict[str, Any], dict[str, Any]]]:
    """``(tokens, omni_kv_load, the producer's params)`` of each prompt, decoded by the
    consumer from the producer's prefill."""
    params = _prefill(prod, prompts)
    assert inventory(NAMESPACE).holds >= len(prompts)  # one copy: the blocks are held
    r = cons.generate(prompts, max_tokens=16, kv_transfer_params=params)
    assert "error" not in r, r
    return [
        (o["token_ids"], o["kv_transfer_params"]["omni_kv_load"], p)
        for o, p in zip(r["outputs"], params, strict=True)
    ]


def test_hybrid_pd_moves_each_layer_its_blocks_and_decodes_the_producers_tokens(
    pair: tuple[EngineProc, EngineProc], gemma: Path
) -> None:
    prod, cons = pair
    prompts = [long_prompt(gemma, 300, seed=7), *make_prompts(gemma, 2, seed=3)]
    ref = prod.generate(prompts, max_tokens=16)  # the producer as an ordinary engine
    assert "error" not in ref, ref
    for ids, (tokens, load, params), want in zip(
        prompts, _decode(prod, cons, prompts), ref["outputs"], strict=True
    ):
        n = len(ids)
        assert tokens == want["token_ids"]
        assert load["ok"] is True and load["tokens"] == n, load
        pages, rest = divmod(load["bytes"], PAGE)
        assert pages == _pages(n) and 0 < rest < 4096, (n, load)  # the rest: the descriptor
        groups = params["remote_block_ids"]
        assert sorted(len(g) for g in groups) == sorted(
            [_blocks(n) - _window_start(n)] * SLIDING + [_blocks(n)] * FULL
        ), groups

    # the same prompts again: the consumer's prefix cache holds all but the last block
    again = _decode(prod, cons, prompts)
    for ids, (tokens, load, _params), want in zip(prompts, again, ref["outputs"], strict=True):
        n = len(ids)
        local = n - load["tokens"]
        assert tokens == want["token_ids"]
        assert load["ok"] is True and 0 < local < n and local % BS == 0, load
        assert load["bytes"] // PAGE == _pages(n, local), (n, local, load)
        assert 0 < load["bytes"] % PAGE < 4096, load
    log = (LOG_DIR / "hybrid-producer.log").read_text(errors="replace")
    assert "sends packed payloads" not in log and "packed payloads instead" not in log


def test_an_abort_while_loading_frees_every_group_and_the_next_load_is_exact(
    pair: tuple[EngineProc, EngineProc], gemma: Path
) -> None:
    prod, cons = pair
    prompt = long_prompt(gemma, 200, seed=41)
    ((tokens, load, params),) = _decode(prod, cons, [prompt])
    assert load["ok"] is True, load
    assert_abort_while_loading_frees_every_block(cons, prompt, params)
    ((again, load, _params),) = _decode(prod, cons, [prompt])
    assert again == tokens and load["ok"] is True, load
