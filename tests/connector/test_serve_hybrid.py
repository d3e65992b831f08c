"""P/D of a sliding-window model through ``vllm serve`` and the example proxy, with vLLM's
defaults for it (hybrid KV cache manager on, prefix caching on): a tiny random Gemma 3
(``tests/_models.tiny_gemma3``: a 64-token window on layers 0-2, full attention on layer 3,
float32) over shared memory, one copy (shm's default).

The reference is the producer itself, asked directly: a request without
``kv_transfer_params`` runs there as an ordinary colocated engine, and its own
``cache_salt`` keeps it from sharing cached blocks with the P/D requests. Asserted: every
token of every completion through the proxy equals that reference (float32: exactly); each
load moves whole pages for every block of the full-attention layer and only the window's
blocks of each sliding layer (vLLM's rule), plus a descriptor, as the ``shared_pages``
format; a prompt the consumer has cached loads only the blocks after its local hit; the
producer gives its payloads back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _models import GEMMA3_BLOCK, GEMMA3_PAGE, gemma3_pages, tiny_gemma3  # noqa: E402
from pd_helpers import long_prompt, make_prompts  # noqa: E402
from serve_helpers import GREEDY, complete, serve_shm_pd, wait_nothing_held  # noqa: E402

FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", str(GEMMA3_BLOCK)]


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[Path, str, str]]:
    """``(model, producer URL, proxy URL)`` of a producer and a consumer ``vllm serve``."""
    path = tiny_gemma3()
    with serve_shm_pd(path, "hybrid-serve", FLAGS) as (prefill, proxy):
        yield path, prefill, proxy


def _tokens(base: str, model: str, ids: list[int], **extra: str) -> tuple[list[int], dict]:
    got = complete(base, model, {"prompt": ids, **GREEDY, "return_token_ids": True, **extra})
    params = got.get("kv_transfer_params") or {}
    return got["choices"][0]["token_ids"], params.get("omni_kv_load", {})


def test_serve_sliding_window_pd_equals_colocated_and_moves_only_the_window(
    deployment: tuple[Path, str, str],
) -> None:
    path, prefill, proxy = deployment
    model = str(path)
    prompts = [long_prompt(path, 300, seed=7), *make_prompts(path, 2, seed=5)]
    for ids in prompts:
        want, _ = _tokens(prefill, model, ids, cache_salt="colocated-reference")
        got, load = _tokens(proxy, model, ids)
        assert got == want, (len(ids), got, want)
        n = len(ids)
        assert load["ok"] is True and load["tokens"] == n, load
        assert load["format"] == "shared_pages", load
        pages, rest = divmod(load["bytes"], GEMMA3_PAGE)
        assert pages == gemma3_pages(n) and 0 < rest < 4096, (n, load)
    # the long prompt again: the consumer's prefix cache holds all but its last block
    ids = prompts[0]
    want, _ = _tokens(prefill, model, ids, cache_salt="colocated-reference")
    got, load = _tokens(proxy, model, ids)
    local = len(ids) - load["tokens"]
    assert got == want
    assert load["ok"] is True and 0 < local < len(ids) and local % GEMMA3_BLOCK == 0, load
    assert load["bytes"] // GEMMA3_PAGE == gemma3_pages(len(ids), local), (local, load)
    assert wait_nothing_held(prefill, model) == 0
