"""P/D of hybrid models with recurrent-state layers, vLLM's defaults (hybrid KV cache
manager, prefix caching in "align" mode): one pair of in-process engines per model,
transport and payload kind. Qwen3-Next's pages are copied straight out of the producer's
cache (one copy) over shared memory, Mooncake's Transfer Engine (TCP) and NIXL (UCX), and
travel in packed frames over Mooncake Store (a loopback master); Granite's travel in
packed frames over shared memory. Mooncake and NIXL pairs run where their wheels import.

Models (``tests/_models``): a tiny random Qwen3-Next (3 gated-delta-net layers, one
full-attention layer, bfloat16), a tiny random LFM2 (3 gated short-conv layers, one
full-attention layer, float32; one copy over shared memory) and a tiny random
GraniteMoeHybrid (Granite 4.0-H: 3 Mamba2 layers, one full-attention layer, float32).

Asserted: the consumer decodes the producer's own greedy tokens (the producer serving
the prompt as an ordinary engine; up to the reference's first near tie, see
``state_models.NEAR_TIE``: the bfloat16 Qwen3-Next's one-token step rounds differently
from a chunk; test_serve_state compares every token against vLLM computing the same
split); a load moves the prompt's ``N - 1`` tokens (the consumer computes the last one
from the loaded state, as with vLLM's NixlConnector): whole attention pages for every
block holding them after the consumer's local prefix, plus exactly one state page per
state layer, and a one-copy payload's descriptor or a packed frame's overhead (which
tells the two apart); a prompt cached on the consumer is a local hit (nothing moves); a
prompt sharing a cached prefix loads only what follows it (against vLLM computing the same
split, see :func:`_split_reference`); a request aborted while its load waits gives back
every attention and state block at once."""

from __future__ import annotations

import contextlib
import importlib.util
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from pd_helpers import (  # noqa: E402
    EngineProc,
    assert_abort_while_loading_frees_every_block,
    engine_cfg,
    engines,
    long_prompt,
    make_prompts,
    omni_ktc,
)
from state_models import (  # noqa: E402
    MODELS,
    NEAR_TIE,
    Hybrid,
    check_state_load_bytes,
    same_up_to_near_tie,
)

from vllm_omni_kv.testing.net import free_port  # noqa: E402

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
#: transports whose consumer fetches a whole payload even where it needs a part of it
WHOLE_OBJECT = ("mooncake_store",)
#: the pull transports' pool and the seconds a consumer waits (TCP reads may retry)
POOL = 64 << 20
RECV_TIMEOUT = 15.0


def _needs(module: str, pair: tuple[str, str, bool]) -> Any:
    return pytest.param(
        pair,
        marks=pytest.mark.skipif(
            importlib.util.find_spec(module) is None, reason=f"no {module} wheel"
        ),
        id="-".join(pair[:2]) + ("-one_copy" if pair[2] else "-packed"),
    )


#: (model, transport, one copy) triples: Qwen3-Next's pages copied straight out of the
#: producer's cache over shared memory (shm's default), Mooncake's Transfer Engine and
#: NIXL (``register_cache``); packed frames for Granite over shared memory
#: (``share_cache: false``) and Qwen3-Next over Mooncake Store (always packed)
PAIRS = [
    pytest.param(("qwen3_next", "shm", True), id="qwen3_next-shm-one_copy"),
    pytest.param(("granite", "shm", False), id="granite-shm-packed"),
    pytest.param(("lfm2", "shm", True), id="lfm2-shm-one_copy"),
    _needs("mooncake", ("qwen3_next", "mooncake", True)),
    _needs("mooncake", ("qwen3_next", "mooncake_store", False)),
    _needs("nixl", ("qwen3_next", "nixl", True)),
]


#: what each configured backend reports carried a load (``UCX_TLS`` unset in tests)
CARRIED_BY = {
    "shm": "shm",
    "mooncake": "mooncake_te:tcp",
    "mooncake_store": "mooncake_store",
    "nixl": "nixl:UCX",
}


def _ktcs(
    transport: str, one_copy: bool, stack: contextlib.ExitStack
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The producer's and the consumer's ``kv_transfer_config`` over ``transport`` (a
    Mooncake master for the store, on ``stack``)."""
    if transport == "shm":
        extra = {"share_cache": one_copy}
        return (
            omni_ktc("kv_producer", backend_extra=extra),
            omni_ktc("kv_consumer", backend_extra=extra),
        )
    if transport == "mooncake_store":
        from vllm_omni_kv.backends.mooncake_store.master import mooncake_master

        extra = stack.enter_context(mooncake_master()).store_config(connect_timeout_s=5.0)
        return (
            omni_ktc("kv_producer", backend=transport, backend_extra=extra),
            omni_ktc(
                "kv_consumer", backend=transport, recv_timeout=RECV_TIMEOUT, backend_extra=extra
            ),
        )
    common: dict[str, Any] = {
        "host": "127.0.0.1",
        "memory_pool_size": POOL,
        "register_cache": one_copy,
    }
    if transport == "mooncake":
        common["protocol"] = "tcp"
    prod = omni_ktc(
        "kv_producer",
        backend=transport,
        backend_extra={**common, "role": "sender", "zmq_port": free_port()},
    )
    cons = omni_ktc(
        "kv_consumer",
        backend=transport,
        recv_timeout=RECV_TIMEOUT,
        backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0},
    )
    return prod, cons


@dataclass
class Pair:
    model: Hybrid
    path: Path
    prod: EngineProc
    cons: EngineProc
    started_s: float
    transport: str
    #: the format each load reports: one copy, or packed pages
    format: str


@pytest.fixture(scope="module", params=PAIRS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    name, transport, one_copy = request.param
    model = MODELS[name]
    path = model.build()
    stack = contextlib.ExitStack()
    prod_ktc, cons_ktc = _ktcs(transport, one_copy, stack)
    t0 = time.monotonic()
    # vLLM picks the block size of a model with state layers (None: its default)
    kw = {"block_size": None, "max_model_len": 1024, "dtype": model.dtype,
          "mamba_ssm_cache_dtype": "float32", "enable_prefix_caching": model.prefix_caching}  # fmt: skip
    with (
        stack,
        engines(
            (f"{name}-{transport}-producer", engine_cfg(path, prod_ktc, **kw)),
            (f"{name}-{transport}-consumer", engine_cfg(path, cons_ktc, **kw)),
        ) as (prod, cons),
    ):
        fmt = "shared_pages" if one_copy else "paged_blocks"
        yield Pair(model, path, prod, cons, time.monotonic() - t0, transport, fmt)


def _decode(pair: Pair, prompts: list[list[int]]) -> list[tuple[list[int], dict[str, Any]]]:
    """``(tokens, omni_kv_load)`` of each prompt decoded by the consumer from the
    producer's prefill."""
    n = len(prompts)
    r = pair.prod.generate(prompts, max_tokens=1, kv_transfer_params=[REMOTE_DECODE] * n)
    assert "error" not in r, r
    params = [o["kv_transfer_params"] for o in r["outputs"]]
    r = pair.cons.generate(prompts, max_tokens=16, kv_transfer_params=params)
    assert "error" not in r, r
    return [(o["token_ids"], o["kv_transfer_params"]["omni_kv_load"]) for o in r["outputs"]]


def _top2_decided(out: dict[str, Any]) -> tuple[list[int], int]:
    """An output's greedy tokens and how many of them precede its first near tie."""
    ties = [i for i, (a, b) in enumerate(out["top2"]) if a - b < NEAR_TIE]
    decided = ties[0] if ties else len(out["token_ids"])
    assert decided > 0, "the reference's first token is a near tie: use another prompt"
    return out["token_ids"], decided


def _reference(pair: Pair, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """The producer's greedy tokens, serving the prompts as an ordinary engine, and how
    many of them precede the first near tie (where another engine may choose either)."""
    r = pair.prod.generate(prompts, max_tokens=16, logprobs=2)
    assert "error" not in r, r
    return [_top2_decided(o) for o in r["outputs"]]


def _split_reference(pair: Pair, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """vLLM computing each prompt as P/D splits it, in the producer as an ordinary engine:
    its first ``N - 1`` tokens as a request of their own (cached in "align" mode), then the
    prompt, which finds them in the prefix cache; under a cache salt of its own, so the P/D
    requests share no block with it. vLLM 0.32's CPU short-conv kernel stores a wrong state
    for a chunk that ends at a block boundary after more than one block (LFM2: measured with
    no connector, see docs/transfers.md), and a P/D load moves that state as computed: this
    reference computes it the same way."""
    salt = f"split-{uuid.uuid4().hex[:8]}"
    out = []
    for ids in prompts:
        r = pair.prod.generate([ids[:-1]], max_tokens=1, cache_salt=salt)
        assert "error" not in r, r
        r = pair.prod.generate([ids], max_tokens=16, logprobs=2, cache_salt=salt)
        assert "error" not in r, r
        out.append(_top2_decided(r["outputs"][0]))
    return out


def test_state_pd_decodes_the_producers_tokens_and_moves_one_state_per_layer(pair: Pair) -> None:
    m = pair.model
    prompts = [long_prompt(pair.path, 300, seed=7), *make_prompts(pair.path, 2, seed=3)]
    ref = _reference(pair, prompts)
    for ids, (tokens, load), want in zip(prompts, _decode(pair, prompts), ref, strict=True):
        assert same_up_to_near_tie(tokens, want), (len(ids), tokens, want)
        assert load["ok"] is True and load["tokens"] == len(ids) - 1, load
        assert load["format"] == pair.format, load
        assert load["transport"] == CARRIED_BY[pair.transport], load
        check_state_load_bytes(m, load, len(ids), 0)


def test_state_pd_prefix_hits_on_the_consumer(pair: Pair) -> None:
    """A prompt of two blocks and a token: the consumer caches the two blocks' attention
    pages and the state after them, so the prompt again is a local hit, and a longer
    prompt sharing them loads only the blocks after them (and the states)."""
    m = pair.model
    if m.prefix_caching is False:
        pytest.skip("this model runs without prefix caching (see MODELS)")
    base = long_prompt(pair.path, 2 * m.block_size + 1, seed=m.prefix_seed)
    longer = base[:-1] + long_prompt(pair.path, m.block_size + 20, seed=m.prefix_seed + 1)
    ref = _split_reference(pair, [base, longer])
    (tokens, load), = _decode(pair, [base])  # fmt: skip
    assert same_up_to_near_tie(tokens, ref[0]), (tokens, ref[0])
    assert load["ok"] is True and load["tokens"] == len(base) - 1, load
    (tokens, load), = _decode(pair, [base])  # fmt: skip
    assert same_up_to_near_tie(tokens, ref[0]), (tokens, ref[0])
    assert load.get("local_hit") is True and load["bytes"] == 0, load
    (tokens, load), = _decode(pair, [longer])  # fmt: skip
    local = 2 * m.block_size
    assert same_up_to_near_tie(tokens, ref[1]), (load, tokens, ref[1])
    assert load["ok"] is True and load["tokens"] == len(longer) - 1 - local, load
    # Mooncake Store serves whole objects: the consumer fetches the whole payload and
    # writes only the blocks after its local prefix; the other transports read just those
    local_read = 0 if pair.transport in WHOLE_OBJECT else local
    check_state_load_bytes(m, load, len(longer), local_read)
    print(f"engine pair started in {pair.started_s:.1f}s")


def test_state_pd_abort_while_loading_frees_every_block(pair: Pair) -> None:
    prompt = long_prompt(pair.path, 150, seed=43)
    ref = _reference(pair, [prompt])
    n = len(prompt)
    r = pair.prod.generate([prompt], max_tokens=1, kv_transfer_params=[REMOTE_DECODE])
    assert "error" not in r, r
    params = r["outputs"][0]["kv_transfer_params"]
    assert_abort_while_loading_frees_every_block(pair.cons, prompt, params)
    # the payload the abort left unclaimed still loads: nothing of it was spoiled
    r = pair.cons.generate([prompt], max_tokens=16, kv_transfer_params=[params])
    assert "error" not in r, r
    (out,) = r["outputs"]
    load = out["kv_transfer_params"]["omni_kv_load"]
    assert same_up_to_near_tie(out["token_ids"], ref[0]), (out["token_ids"], ref[0])
    assert load["ok"] is True and load["tokens"] <= n - 1, load
