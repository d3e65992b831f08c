"""Two ``vllm serve`` processes with ``"backend": "nixl"`` and the example proxy: the
completions through the proxy (prefill on one server, KV pulled over NIXL, decode on the
other) equal the producer's own completions of the same prompts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "connector"))

from pd_helpers import make_prompts  # noqa: E402
from serve_helpers import GREEDY, complete, ktc, serve_pd  # noqa: E402

from vllm_omni_kv.testing.net import free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nixl]

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

EXTRA = {"host": "127.0.0.1", "memory_pool_size": 64 << 20}


@pytest.fixture(scope="module")
def urls(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    producer = ktc("kv_producer", "nixl", {**EXTRA, "zmq_port": free_port()}, send_ttl=300)
    consumer = ktc("kv_consumer", "nixl", {**EXTRA, "side_channel_timeout_s": 5}, recv_timeout=30)
    with serve_pd(tiny_model_dir, producer, consumer, "nixl-serve", worker_in_core=True) as urls:
        yield urls


def test_serve_completions_over_nixl_match_colocated(
    urls: tuple[str, str], tiny_model_dir: Path
) -> None:
    prefill, proxy = urls
    model = str(tiny_model_dir)
    for ids in make_prompts(tiny_model_dir, 3, seed=41):
        # the producer is an ordinary engine for requests without transfer params
        ref = complete(prefill, model, {"prompt": ids, **GREEDY})
        got = complete(proxy, model, {"prompt": ids, **GREEDY})
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        load = got["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["bytes"] > 0 and load["tokens"] > 0, load
