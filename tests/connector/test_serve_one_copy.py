"""Two ``vllm serve`` processes and the example proxy, in the one-copy modes of the pull
backends that run on this machine: Mooncake TE (TCP) and NIXL (UCX) with
``register_cache`` (shm's one copy is its default: test_pd_serve's example deployment). Completions through the proxy (prefill on one server, its KV pages
copied once out of its cache by the other) equal the producer's own completions of the
same prompts, exactly the pages move, and the producer gives its blocks back."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import LOG_DIR, make_prompts, sweep_dead_segments
from serve_helpers import GREEDY, complete, ktc, serve_pd, wait_nothing_held

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (backend, producer backend_extra, consumer backend_extra)
    "mooncake_cache": (
        "mooncake",
        {
            "host": "127.0.0.1",
            "protocol": "tcp",
            "memory_pool_size": 16 << 20,
            "register_cache": True,
        },
        {"side_channel_timeout_s": 5},
    ),  # fmt: skip
    "nixl_cache": (
        "nixl",
        {"host": "127.0.0.1", "memory_pool_size": 16 << 20, "register_cache": True},
        {"side_channel_timeout_s": 5},
    ),
}
_MC = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake is not installed"
)
_NIXL = [
    pytest.mark.nixl,
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed"),
]
#: bytes of one 32-token block of the tiny fp32 model (2 layers, 2 KV heads, head size 64)
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 32


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("mooncake_cache", marks=[_MC]),
        pytest.param("nixl_cache", marks=_NIXL),
    ],
)
def urls(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[tuple[str, str, str]]:
    """``(producer URL, proxy URL, the servers' log name)``."""
    backend, extra, consumer_extra = MODES[request.param]
    producer = ktc("kv_producer", backend, extra, send_ttl=60)
    consumer = ktc("kv_consumer", backend, {**extra, **consumer_extra}, recv_timeout=30)
    name = f"{request.param}-serve"
    try:
        # the worker in the engine-core process (a TP-1 GPU server's layout)
        with serve_pd(tiny_model_dir, producer, consumer, name, worker_in_core=True) as urls:
            yield (*urls, name)
    finally:
        sweep_dead_segments()


def test_serve_one_copy_completions_match_colocated(
    urls: tuple[str, str, str], tiny_model_dir: Path
) -> None:

    prefill, proxy, name = urls
    model = str(tiny_model_dir)
    for ids in make_prompts(tiny_model_dir, 3, seed=51):
        # the producer is an ordinary engine for requests without transfer params
        ref = complete(prefill, model, {"prompt": ids, **GREEDY})
        got = complete(proxy, model, {"prompt": ids, **GREEDY})
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        load = got["kv_transfer_params"]["omni_kv_load"]
        pages = -(-len(ids) // 32) * BLOCK_BYTES  # the request's pages and a small descriptor
        assert load["ok"] is True and pages < load["bytes"] < pages + 4096, load
    # the producer gets its blocks back: the pull backends hold them in memory, reported
    # by the producer's held-payload gauge
    assert wait_nothing_held(prefill, model) == 0
    # the producer's cache was in its backend's region: no fallback to packed payloads
    assert "packed payloads instead" not in (LOG_DIR / f"{name}-p.log").read_text()
