"""Hybrid-model P/D: KV bytes moved and consumer time to first token for a Gemma 3-shaped
model (sliding-window layers and one global layer), with vLLM's hybrid KV cache manager on
(vLLM's default: each sliding layer keeps, and OmniKV moves, only the blocks inside its
window) and off (every layer keeps every token), and vLLM's own ``NixlConnector`` (HMA on,
UCX, CPU buffers) where it runs.

Model (defaults): random weights written with ``transformers``, 6 layers (5 sliding with a
128-token window, 1 global), 4 KV heads of 128, bfloat16 where the CPU has it natively
(else float32); 8 prompts of ~2,000 tokens.
Producer and consumer are in-process engines (``vllm_omni_kv.testing.engine_proc``), prefix
caching off; the consumer loads a batch with ``max_tokens=1`` (TTFT: wall clock of that
``generate``, median of ``--repeats`` after a warm-up round). Bytes are the sum of the
consumer's ``omni_kv_load.bytes`` (``NixlConnector`` reports none); the expected byte count
of each configuration is computed from vLLM's window rule and printed beside it. Tokens are
checked against the producer's own greedy answer (no transfer).

    python benchmarks/hybrid_bench.py      # writes benchmarks/results/hybrid_bench.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_omni_kv.testing.engine_proc import EngineProc
from vllm_omni_kv.testing.net import free_port

REPO = Path(__file__).resolve().parents[1]
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
BLOCK = 32  # vLLM's CPU block size here
CONFIGS = ("omnikv_hma_on", "omnikv_hma_off", "nixl_connector")


def write_model(
    out: Path, layers: int, window: int, kv_heads: int, head_dim: int, dtype: str
) -> Path:
    """A random Gemma 3 text model (``layers - 1`` sliding layers then one global) with the
    package's tiny tokenizer, written once (:func:`vllm_omni_kv.tiny_model.write_model_dir`)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from vllm_omni_kv.tiny_model import write_model_dir, write_tiny_model

    def build(tmp: Path) -> None:
        kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg = Gemma3TextConfig(
            vocab_size=2048,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=layers,
            num_attention_heads=2 * kv_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=window,
            layer_types=kinds,
            max_position_embeddings=8192,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg).to(getattr(torch, dtype))  # type: ignore[arg-type]
        model.config.architectures = ["Gemma3ForCausalLM"]
        model.save_pretrained(str(tmp), safe_serialization=True)

    return write_model_dir(out, build, write_tiny_model(out.parent / "hybrid-bench-tokenizer"))


def expected_bytes(lengths: list[int], layers: int, window: int, page: int, hma: bool) -> int:
    """What the consumer's layers keep: every block for the global layer (and, HMA off, for
    every layer); from block ``(n - window + 1) // BLOCK`` for a sliding layer (vLLM)."""
    total = 0
    for n in lengths:
        blocks = -(-n // BLOCK)
        kept = blocks - (max(0, n - window + 1) // BLOCK if hma else 0)
        total += page * (blocks + (layers - 1) * kept)
    return total


def nixl_configs(base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """Producer and consumer configs of vLLM's ``NixlConnector`` (UCX, CPU buffers)."""
    ktc = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
           "kv_connector_extra_config": {"backends": ["UCX"]}}  # fmt: skip
    prod = {**base, "kv_transfer_config": {**ktc, "kv_role": "kv_producer"}}
    cons = {**base, "kv_transfer_config": {**ktc, "kv_role": "kv_consumer"}}
    return prod, cons, {"nixl": True}


def _configs(name: str, base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """Producer config, consumer config, and per-engine environment of ``name``."""
    if name == "nixl_connector":
        return nixl_configs(base)
    hma_off = name == "omnikv_hma_off"
    cfg = {**base, "disable_hybrid_kv_cache_manager": True} if hma_off else base
    ktc = {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {"backend": "shm"}}
    prod = {**cfg, "kv_transfer_config": {**ktc, "kv_role": "kv_producer"}}
    cons = {**cfg, "kv_transfer_config": {**ktc, "kv_role": "kv_consumer",
                                          "kv_load_failure_policy": "fail"}}  # fmt: skip
    return prod, cons, {}


def generate_checked(eng: EngineProc, prompts: list[list[int]], n: int, params: Any = None) -> dict:
    r = eng.generate(prompts, n, params, timeout=900.0)
    if "error" in r:
        raise RuntimeError(f"generate failed: {r['error']}\n{eng.tail()}")
    return r


def start_pair(name: str, cfgs: list[dict[str, Any]], env: dict[str, str], logs: Path) -> list:
    nixl = cfgs[2].get("nixl", False)
    engines = []
    for role, cfg in zip(("producer", "consumer"), cfgs[:2], strict=True):
        extra = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if nixl else {}
        engines.append(EngineProc(cfg, env={**env, **extra}, log=logs / f"{name}-{role}.log"))
    try:
        for e in engines:
            e.wait_ready(600)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def measure_pair(
    name: str, cfgs: tuple[dict, dict, dict], prompts: list[list[int]], env: dict, a: Any
) -> dict[str, Any]:
    """Consumer TTFT of the batch (median of ``a.repeats`` after a warm-up round), the bytes
    and formats of its loads, and the prompts whose first 4 tokens equal the producer's own,
    for the producer and consumer configs ``cfgs`` (:func:`start_pair`)."""
    prod, cons = start_pair(name, list(cfgs), env, a.logs)
    try:
        want = [o["token_ids"] for o in generate_checked(prod, prompts, 4)["outputs"]]
        ttfts: list[float] = []
        loads: list[dict[str, Any]] = []
        for i in range(a.repeats + 1):  # the first round warms both engines up
            pre = generate_checked(prod, prompts, 1, [PREFILL] * len(prompts))
            params = [o["kv_transfer_params"] for o in pre["outputs"]]
            t0 = time.perf_counter()
            got = generate_checked(cons, prompts, 1, params)
            if i:
                ttfts.append(time.perf_counter() - t0)
            loads = [
                (o["kv_transfer_params"] or {}).get("omni_kv_load", {}) for o in got["outputs"]
            ]
        pre = generate_checked(prod, prompts, 1, [PREFILL] * len(prompts))
        full = generate_checked(cons, prompts, 4, [o["kv_transfer_params"] for o in pre["outputs"]])
        match = sum(o["token_ids"] == w for o, w in zip(full["outputs"], want, strict=True))
    finally:
        prod.stop()
        cons.stop()
    moved = sum(int(x.get("bytes", 0)) for x in loads) if loads and loads[0] else None
    formats = sorted({str(x.get("format")) for x in loads if x.get("ok")})
    return {"ttft_s": statistics.median(ttfts), "ttft_samples": ttfts, "bytes_moved": moved,
            "loads_ok": sum(bool(x.get("ok")) for x in loads), "formats": formats,
            "tokens_match": match}  # fmt: skip


def plot_rows(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in rows if "ttft_s" in rows[n]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (
        (axes[0], [(rows[n].get("bytes_moved") or 0) / 2**20 for n in names], "KV moved (MiB)"),
        (axes[1], [rows[n]["ttft_s"] for n in names], "consumer TTFT, whole batch (s)"),
    )
    for ax, vals, label in panels:
        bars = ax.bar(names, vals, color=["#2a7ab0", "#888888", "#5aa05a", "#c07a2a"][: len(names)])
        ax.set_ylabel(label)
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
        ax.tick_params(axis="x", rotation=15)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it natively")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args(argv)
    a.logs = Path(tempfile.mkdtemp(prefix="hybrid_bench_logs_"))
    from transformers import AutoTokenizer

    from vllm_omni_kv.tiny_model import fast_cpu_dtype, prompt_text

    a.dtype_reason = "--dtype"
    if a.dtype == "auto":
        a.dtype, a.dtype_reason = fast_cpu_dtype()
    tag = f"gemma3-bench-{a.layers}l-w{a.window}-{a.kv_heads}x{a.head_dim}-{a.dtype}-v1"
    model = write_model(REPO / ".cache" / "tiny-models" / tag, a.layers, a.window,
                        a.kv_heads, a.head_dim, a.dtype)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [list(tok(prompt_text(700 + i, a.prompt_tokens))["input_ids"][: a.prompt_tokens])
               for i in range(a.prompts)]  # fmt: skip
    lengths = [len(p) for p in prompts]
    itemsize = 2 if a.dtype in ("bfloat16", "float16") else 4
    page = BLOCK * 2 * a.kv_heads * a.head_dim * itemsize  # one block of one layer, K and V
    base = {"model": str(model), "dtype": a.dtype, "in_process": True,
            "max_model_len": a.prompt_tokens + 64, "max_num_seqs": a.prompts,
            "max_num_batched_tokens": max(8192, sum(lengths)), "enable_prefix_caching": False}  # fmt: skip
    kv_gib = max(1, -(-4 * sum(lengths) * page // BLOCK * a.layers // (1 << 30)))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_LOGGING_LEVEL="WARNING")
    rows: dict[str, dict[str, Any]] = {}
    for name in filter(None, a.configs.split(",")):
        hma = name != "omnikv_hma_off"
        want = expected_bytes(lengths, a.layers, a.window, page, hma)
        try:
            got = measure_pair(name, _configs(name, base), prompts, env, a)
            rows[name] = {**got, "expected_bytes": want}
        except Exception as e:  # record why a configuration could not run
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "ttft_samples"}))
    on, off = rows.get("omnikv_hma_on", {}), rows.get("omnikv_hma_off", {})
    summary = {}
    if on.get("bytes_moved") and off.get("bytes_moved"):
        summary = {"bytes_on_vs_off": round(on["bytes_moved"] / off["bytes_moved"], 3),
                   "ttft_on_vs_off": round(on["ttft_s"] / off["ttft_s"], 3)}  # fmt: skip
    out = {"workload": {k: getattr(a, k) for k in ("prompts", "prompt_tokens", "layers", "window",
                                                  "kv_heads", "head_dim", "repeats", "dtype", "dtype_reason")},
           "prompt_lengths": lengths, "page_bytes": page, "results": rows, "summary": summary,
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": os.getloadavg(), "logs": str(a.logs)}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hybrid_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    plot_rows(rows, a.out / "hybrid_bench.png",
          f"Gemma 3-shaped, {a.layers} layers (window {a.window}), {a.prompts} x {a.prompt_tokens} tokens")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
