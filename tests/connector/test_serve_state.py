"""P/D of a hybrid model with recurrent-state layers through ``vllm serve`` and the example
proxy, with vLLM's defaults for it (hybrid KV cache manager on, prefix caching in "align"
mode, vLLM's block size): a tiny random Qwen3-Next (three gated-delta-net layers and one
full-attention layer, bfloat16 with a float32 SSM state) over shared memory, one copy (shm's
default: the consumer copies the attention and state pages out of the producer's cache).

The reference is vLLM itself computing the same split: a plain engine (no connector) that
prefills the prompt's first ``N - 1`` tokens as one chunk and its last token as a step of its
own (``max_num_batched_tokens = N - 1``), as P/D does (the producer prefills ``N - 1``
tokens, the consumer computes the last one from the loaded state). Asserted: every token of
every completion through the proxy equals that reference; each load moves the prompt's
``N - 1`` tokens as the attention pages of their blocks plus one state page per state layer;
the producer gives its payloads back. vLLM's bfloat16 gated-delta-net kernels round a
one-token step differently from a chunk, so a colocated server that prefills the whole prompt
as one chunk can answer other tokens (measured here: from the third or fourth token of these
prompts); docs/transfers.md has the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pd_helpers import engine_cfg, engines, long_prompt  # noqa: E402
from serve_helpers import GREEDY, complete, serve_shm_pd, wait_nothing_held  # noqa: E402
from state_models import MODELS, check_state_load_bytes  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = MODELS["qwen3_next"]
FLAGS = ["--dtype", MODEL.dtype, "--max-model-len", "1024", "--mamba-ssm-cache-dtype", "float32"]
#: every prompt's length: the reference engine splits each at N - 1
N = 300


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[Path, str, str]]:
    """``(model, producer URL, proxy URL)`` of a producer and a consumer ``vllm serve``."""
    path = MODEL.build()
    with serve_shm_pd(path, "state-serve", FLAGS) as (prefill, proxy):
        yield path, prefill, proxy


def _split_reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of a plain engine that computes each prompt as ``N - 1`` tokens, then
    the last one as a step of its own."""
    cfg = engine_cfg(
        path,
        None,
        dtype=MODEL.dtype,
        block_size=None,
        max_model_len=1024,
        mamba_ssm_cache_dtype="float32",
        enable_prefix_caching=False,  # "align" mode would end the first chunk at a block
        max_num_batched_tokens=N - 1,
    )
    tokens = []
    with engines(("state-split-reference", cfg)) as (ref,):
        for ids in prompts:  # one at a time, as the proxy sends them (a batch rounds otherwise)
            out = ref.generate([ids], max_tokens=GREEDY["max_tokens"])
            assert "error" not in out, out
            tokens.append(out["outputs"][0]["token_ids"])
    return tokens


def test_serve_state_pd_equals_vllm_computing_the_same_split(
    deployment: tuple[Path, str, str],
) -> None:
    path, prefill, proxy = deployment
    model = str(path)
    prompts = [long_prompt(path, N, seed=s) for s in (17, 7)]
    assert all(len(p) == N for p in prompts)
    for ids, want in zip(prompts, _split_reference(path, prompts), strict=True):
        got = complete(proxy, model, {"prompt": ids, **GREEDY, "return_token_ids": True})
        assert got["choices"][0]["token_ids"] == want, (got["choices"][0]["token_ids"], want)
        load = got["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["tokens"] == N - 1, load
        # shm's default: the pages, states included, copied out of the producer's cache
        assert load["format"] == "shared_pages", load
        check_state_load_bytes(MODEL, load, N, 0)
    assert wait_nothing_held(prefill, model) == 0
