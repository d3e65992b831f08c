"""P/D of a hybrid model with vLLM's hybrid KV cache manager on: a tiny random Gemma 3
(``tests/_models.tiny_gemma3``: a 64-token sliding window on layers 0-2, full attention
on layer 3, float32, blocks of 32) between two in-process engines, one copy over shared
memory (shm's default) and over Mooncake's Transfer Engine (``register_cache``: the
consumer reads each group's pages out of the producer's registered cache over TCP).

Asserted: the consumer decodes the producer's own greedy tokens for every prompt; each
load moves whole pages for every block of the full-attention layer and only the window's
blocks of each sliding layer (vLLM's rule: after ``n`` tokens a window of ``w`` keeps
blocks from ``(n - w + 1) // 32``); ``remote_block_ids`` holds one list per KV cache
group; a prompt cached on the consumer loads only the blocks after its local hit. The
payloads are one copy: over shared memory each prefill leaves a hold on the producer's
blocks (a shared-pages payload; a packed one holds none), every load reports the
``shared_pages`` format and moves exactly its pages plus a descriptor under 4 KiB, and the
producer never logs a fallback to packed payloads. A request aborted while its load waits
is cancelled at once and gives back every block.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from _models import (  # noqa: E402
    GEMMA3_BLOCK,
    GEMMA3_LAYERS,
    GEMMA3_PAGE,
    gemma3_blocks,
    gemma3_pages,
    gemma3_window_start,
    tiny_gemma3,
)
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
from vllm_omni_kv.testing.net import free_port  # noqa: E402

BS = GEMMA3_BLOCK
PAGE = GEMMA3_PAGE
SLIDING = GEMMA3_LAYERS.count("sliding_attention")
FULL = GEMMA3_LAYERS.count("full_attention")
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
_blocks, _window_start, _pages = gemma3_blocks, gemma3_window_start, gemma3_pages


@pytest.fixture(scope="module")
def gemma() -> Path:
    return tiny_gemma3()


@dataclass
class Pair:
    prod: EngineProc
    cons: EngineProc
    transport: str
    name: str  # the engines' log name prefix


def _ktcs(transport: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if transport == "shm":
        return omni_ktc("kv_producer"), omni_ktc("kv_consumer")
    common = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 16 << 20,
              "register_cache": True}  # fmt: skip
    return (
        omni_ktc("kv_producer", backend=transport,
                 backend_extra={**common, "role": "sender", "zmq_port": free_port()}),
        omni_ktc("kv_consumer", backend=transport, recv_timeout=15,
                 backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0}),
    )  # fmt: skip


@pytest.fixture(
    scope="module",
    params=[
        "shm",
        pytest.param(
            "mooncake",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("mooncake") is None, reason="no Mooncake wheel"
            ),
        ),
    ],
)
def pair(request: pytest.FixtureRequest, gemma: Path) -> Iterator[Pair]:
    transport = request.param
    name = f"hybrid-{transport}"
    prod_ktc, cons_ktc = _ktcs(transport)
    with engines(
        (f"{name}-producer", engine_cfg(gemma, prod_ktc)),
        (f"{name}-consumer", engine_cfg(gemma, cons_ktc)),
    ) as (prod, cons):
        yield Pair(prod, cons, transport, name)


def _prefill(prod: EngineProc, prompts: list[list[int]]) -> list[dict[str, Any]]:
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[REMOTE_DECODE] * len(prompts))
    assert "error" not in r, r
    return [o["kv_transfer_params"] for o in r["outputs"]]


def _decode(
    pair: Pair, prompts: list[list[int]]
) -> list[tuple[list[int], dict[str, Any], dict[str, Any]]]:
    """``(tokens, omni_kv_load, the producer's params)`` of each prompt, decoded by the
    consumer from the producer's prefill."""
    params = _prefill(pair.prod, prompts)
    if pair.transport == "shm":  # one copy: the blocks are held (hold files)
        assert inventory(NAMESPACE).holds >= len(prompts)
    r = pair.cons.generate(prompts, max_tokens=16, kv_transfer_params=params)
    assert "error" not in r, r
    out = [
        (o["token_ids"], o["kv_transfer_params"]["omni_kv_load"], p)
        for o, p in zip(r["outputs"], params, strict=True)
    ]
    for _tokens, load, _params in out:
        assert load.get("format", "shared_pages") == "shared_pages", load  # absent: local hit
    return out


def test_hybrid_pd_moves_each_layer_its_blocks_and_decodes_the_producers_tokens(
    pair: Pair, gemma: Path
) -> None:
    prod = pair.prod
    prompts = [long_prompt(gemma, 300, seed=7), *make_prompts(gemma, 2, seed=3)]
    ref = prod.generate(prompts, max_tokens=16)  # the producer as an ordinary engine
    assert "error" not in ref, ref
    for ids, (tokens, load, params), want in zip(
        prompts, _decode(pair, prompts), ref["outputs"], strict=True
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
    again = _decode(pair, prompts)
    for ids, (tokens, load, _params), want in zip(prompts, again, ref["outputs"], strict=True):
        n = len(ids)
        local = n - load["tokens"]
        assert tokens == want["token_ids"]
        assert load["ok"] is True and 0 < local < n and local % BS == 0, load
        assert load["bytes"] // PAGE == _pages(n, local), (n, local, load)
        assert 0 < load["bytes"] % PAGE < 4096, load
    log = (LOG_DIR / f"{pair.name}-producer.log").read_text(errors="replace")
    assert "sends packed payloads" not in log and "packed payloads instead" not in log


def test_an_abort_while_loading_frees_every_group_and_the_next_load_is_exact(
    pair: Pair, gemma: Path
) -> None:
    prompt = long_prompt(gemma, 200, seed=41)
    ((tokens, load, params),) = _decode(pair, [prompt])
    assert load["ok"] is True, load
    assert_abort_while_loading_frees_every_block(pair.cons, prompt, params)
    ((again, load, _params),) = _decode(pair, [prompt])
    assert again == tokens and load["ok"] is True, load
