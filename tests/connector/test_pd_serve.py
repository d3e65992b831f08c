"""Through the OpenAI server: two ``vllm serve`` processes with ``--kv-transfer-config``
(the example configs) and the example proxy, driven by an HTTP client. The deployment is
the session's ``example_pd`` (shared with test_pd_load)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from pd_helpers import LOG_DIR, SERVE_NAMESPACE, make_prompts
from serve_helpers import Servers, wait_nothing_held

from vllm_omni_kv.backends.shm.inventory import inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def servers(example_pd: Servers) -> Servers:
    """The session's example deployment (shared with test_pd_load)."""
    return example_pd


GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


#: bytes of one 32-token block of the tiny fp32 model (2 layers, 2 KV heads, head size 64)
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 32


def test_completions_through_proxy_match_colocated(servers: Servers, tiny_model_dir: Path) -> None:
    """The example configs use shm's default, one copy: exactly the request's pages move
    (and a descriptor of about a kilobyte), out of the producer's cache, placed in shared
    memory by vLLM's own CPU process layout; the producer gets its blocks back."""
    prompts = make_prompts(tiny_model_dir, 3, seed=11)
    for ids in prompts:
        # the producer is an ordinary engine for requests without transfer params
        ref = servers.post(servers.prefill, "/v1/completions", {"prompt": ids, **GREEDY})
        got = servers.post(servers.proxy, "/v1/completions", {"prompt": ids, **GREEDY})
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        load = got["kv_transfer_params"]["omni_kv_load"]
        pages = -(-len(ids) // 32) * BLOCK_BYTES
        assert load["ok"] is True and load["tokens"] == len(ids), load
        assert pages < load["bytes"] < pages + 4096, load
        assert got["usage"]["prompt_tokens"] == len(ids)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and inventory(SERVE_NAMESPACE).holds:
        time.sleep(0.2)
    assert inventory(SERVE_NAMESPACE).holds == 0, inventory(SERVE_NAMESPACE)
    assert wait_nothing_held(servers.prefill, servers.model) == 0
    assert "packed payloads instead" not in (LOG_DIR / "serve-producer.log").read_text()


def test_chat_through_proxy_matches_colocated(servers: Servers) -> None:
    msgs = [{"role": "user", "content": "kv cache prefill decode stage " * 40}]
    ref = servers.post(servers.prefill, "/v1/chat/completions", {"messages": msgs, **GREEDY})
    got = servers.post(servers.proxy, "/v1/chat/completions", {"messages": msgs, **GREEDY})
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert got["kv_transfer_params"]["omni_kv_load"]["ok"] is True


def test_streaming_through_proxy(servers: Servers, tiny_model_dir: Path) -> None:
    ids = make_prompts(tiny_model_dir, 1, seed=12)[0]
    ref = servers.post(servers.prefill, "/v1/completions", {"prompt": ids, **GREEDY})
    r = requests.post(
        servers.proxy + "/v1/completions",
        json={"model": servers.model, "prompt": ids, "stream": True, **GREEDY},
        stream=True,
        timeout=120,
    )
    assert r.status_code == 200
    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    assert text == ref["choices"][0]["text"]


def test_consumer_logs_connector_stats(servers: Servers) -> None:
    # vLLM's stat logger aggregates our KVConnectorStats and logs reduce()
    deadline = time.monotonic() + 15
    pat = re.compile(r"KV Transfer metrics: .*bytes_received=(\d+)")
    while time.monotonic() < deadline:
        hits = [
            int(m.group(1)) for m in pat.finditer(servers.decode_log.read_text(errors="replace"))
        ]
        if any(h > 0 for h in hits):
            return
        time.sleep(0.5)
    pytest.fail("the consumer never logged KV Transfer metrics with bytes_received > 0")


def test_consumer_exports_prometheus_metrics(servers: Servers) -> None:
    """build_prom_metrics: the consumer's /metrics carries our loads, bytes and latency."""
    deadline = time.monotonic() + 15
    want = re.compile(r"^vllm:omnikv_loads_total\{[^}]*\} ([0-9.e+]+)$", re.M)
    text = ""
    while time.monotonic() < deadline:
        text = requests.get(servers.decode + "/metrics", timeout=10).text
        m = want.search(text)
        if m and float(m.group(1)) > 0:
            assert re.search(r"^vllm:omnikv_received_bytes_total\{[^}]*\} [1-9]", text, re.M)
            assert re.search(r"^vllm:omnikv_load_seconds_count\{[^}]*\} [1-9]", text, re.M)
            assert "vllm:omnikv_load_failures_total{" in text  # by reason, zero so far
            # remote hits are labelled p2p by vLLM's own counter, not external_unspecified
            p2p = re.search(
                r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="p2p"[^}]*\} ([0-9.e+]+)$',
                text,
                re.M,
            )
            by_source = [ln for ln in text.splitlines() if "cached_by_source_total{" in ln]
            assert p2p and float(p2p.group(1)) > 0, f"remote hits not labelled p2p: {by_source}"
            unspec = re.search(
                r"^vllm:prompt_tokens_cached_by_source_total\{[^}]*"
                r'source="external_unspecified"[^}]*\} ([0-9.e+]+)$',
                text,
                re.M,
            )
            assert unspec is None or float(unspec.group(1)) == 0
            ours = [ln for ln in text.splitlines() if "omnikv" in ln]
            (LOG_DIR / "consumer-metrics.txt").write_text("\n".join(ours) + "\n")
            return
        time.sleep(0.5)
    pytest.fail(f"no vllm:omnikv_loads_total > 0 on the consumer's /metrics: {text[-2000:]}")


def test_proxy_health(servers: Servers) -> None:
    r = requests.get(servers.proxy + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["healthy"] is True


# -- tail-only transfers and cancellation (the consumer's prefix cache is on) ---------------


def _prefill(servers: Servers, ids: list[int]) -> dict[str, Any]:
    """The P step of the proxy by hand: the producer's kv_transfer_params for ``ids``."""
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    params: dict[str, Any] = servers.post(servers.prefill, "/v1/completions", body)[
        "kv_transfer_params"
    ]
    return params


def _decode(servers: Servers, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    body = {"prompt": ids, "kv_transfer_params": params, **GREEDY}
    return servers.post(servers.decode, "/v1/completions", body)


def _payload_published(params: dict[str, Any]) -> bool:
    """Whether the producer's shared-memory payload for ``params`` is still unclaimed."""
    from vllm_omni_kv.backends.shm import arena
    from vllm_omni_kv.backends.shm.connector import index_name
    from vllm_omni_kv.kvcache.kv_utils import get_kv_connector_key

    key = get_kv_connector_key(params["remote_transfer_id"], "prefill", 0, 0, 0)
    name = index_name(SERVE_NAMESPACE, "prefill", "decode", key)
    return os.path.exists(os.path.join(arena.SHM_DIR, name))


def test_prefix_hit_moves_only_the_missing_blocks(servers: Servers, tiny_model_dir: Path) -> None:
    base, other = make_prompts(tiny_model_dir, 2, seed=31)
    cold_ids = other + base[:120]  # as long as the extended prompt, nothing cached
    ext = base + other[:120]  # starts with ``base``, which the consumer will hold
    first = _decode(servers, base, _prefill(servers, base))
    assert first["kv_transfer_params"]["omni_kv_load"]["ok"] is True
    cold = _decode(servers, cold_ids, _prefill(servers, cold_ids))["kv_transfer_params"]
    hit_resp = _decode(servers, ext, _prefill(servers, ext))
    hit = hit_resp["kv_transfer_params"]["omni_kv_load"]
    c = cold["omni_kv_load"]
    assert c["ok"] is True and hit["ok"] is True, (c, hit)
    cached = (len(base) // 32) * 32
    assert hit["tokens"] == len(ext) - cached, hit  # only what the consumer lacks
    assert c["tokens"] == len(cold_ids)
    ratio = (hit["bytes"] / hit["tokens"]) / (c["bytes"] / c["tokens"])
    assert ratio <= 1.25, (hit, c, ratio)
    ref = servers.post(servers.prefill, "/v1/completions", {"prompt": ext, **GREEDY})
    assert hit_resp["choices"][0]["text"] == ref["choices"][0]["text"]


def test_full_local_hit_loads_only_the_last_block(servers: Servers, tiny_model_dir: Path) -> None:
    ids = make_prompts(tiny_model_dir, 1, seed=32)[0]
    assert _decode(servers, ids, _prefill(servers, ids))["kv_transfer_params"]["omni_kv_load"]["ok"]
    params = _prefill(servers, ids)  # a second payload for a prompt the consumer holds
    assert _payload_published(params)
    got = _decode(servers, ids, params)
    load = got["kv_transfer_params"]["omni_kv_load"]
    # vLLM's local hit is every full block but the last; the rest (under a block) is loaded
    assert load["ok"] is True and not load.get("local_hit"), load
    assert load["tokens"] == len(ids) - (len(ids) - 1) // 32 * 32 and load["bytes"] > 0, load
    deadline = time.monotonic() + 10
    while _payload_published(params) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _payload_published(params), "the producer's payload was not released"
    ref = servers.post(servers.prefill, "/v1/completions", {"prompt": ids, **GREEDY})
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]


def _kv_usage(servers: Servers) -> float:
    text = requests.get(servers.decode + "/metrics", timeout=10).text
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    assert m, "the consumer exports no vllm:kv_cache_usage_perc"
    return float(m.group(1))


def test_aborted_load_is_cancelled_and_frees_its_blocks(
    servers: Servers, tiny_model_dir: Path
) -> None:
    ids = make_prompts(tiny_model_dir, 1, seed=33)[0]
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "no-such-producer",
        "remote_request_id": f"never-sent-{time.time_ns()}",
    }
    mark = servers.decode_log.stat().st_size
    r = requests.post(
        servers.decode + "/v1/completions",
        json={
            "model": servers.model,
            "prompt": ids,
            "stream": True,
            "kv_transfer_params": params,
            **GREEDY,
        },
        stream=True,
        timeout=60,
    )
    assert r.status_code == 200
    time.sleep(1.5)  # the load waits for a payload that never comes (recv_timeout is 30 s)
    assert _kv_usage(servers) > 0  # the waiting request holds its blocks
    r.close()  # the client hangs up: vLLM aborts the request
    pat = re.compile(r"KV load of request \S+ cancelled after ([0-9.]+)s")
    deadline = time.monotonic() + 10
    found = None
    while found is None and time.monotonic() < deadline:
        with open(servers.decode_log, "rb") as f:
            f.seek(mark)
            found = pat.search(f.read().decode(errors="replace"))
        time.sleep(0.05)
    assert found, "the aborted request's load was not cancelled"
    assert float(found.group(1)) < 5, found.group(0)  # not at recv_timeout
    deadline = time.monotonic() + 10
    while _kv_usage(servers) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kv_usage(servers) == 0, "the cancelled load's blocks were not freed"
    got = servers.post(servers.proxy, "/v1/completions", {"prompt": ids, **GREEDY})
    assert got["kv_transfer_params"]["omni_kv_load"]["ok"] is True
