"""Recurrent-state P/D: KV bytes moved and consumer time to first token for a Qwen3-Next-shaped
model (gated-delta-net layers and full-attention layers, vLLM's defaults: hybrid KV cache
manager on), with OmniKVConnector over shared memory in its two payload kinds: one copy (the
consumer copies the attention and state pages out of the producer's cache; shm's default) and
packed frames (``share_cache: false``), against recomputing the prompt on the consumer (a
plain engine prefilling it) and vLLM's own ``NixlConnector`` (UCX, CPU buffers) where it runs.

Model (defaults): random weights written with ``transformers``, 8 layers (3 gated-delta-net
layers per full-attention layer, as Qwen3-Next), GDN state 4 value heads of 128 x 128 (float32),
attention 2 KV heads of 128, bfloat16 (vLLM's CPU GDN kernel); 8 prompts of ~2,000 tokens.
Engines are in-process (``vllm_omni_kv.testing.engine_proc``), prefix caching off. TTFT is the
wall clock of the consumer's ``generate`` of the batch with ``max_tokens=1`` (median of
``--repeats`` after a warm-up round); for ``recompute`` it is the plain engine's. Bytes are the
sum of the consumer's ``omni_kv_load.bytes``; the expected count (each attention layer's pages
of the prompt's ``N - 1`` tokens plus one state page per state layer) is printed beside it.
Tokens (4 per prompt) are compared with the producer's own greedy answer (no transfer); a
bfloat16 GDN model may differ after a near tie (docs/transfers.md).

    python benchmarks/state_bench.py      # writes benchmarks/results/state_bench.{json,png}
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

from hybrid_bench import generate_checked, measure_pair, nixl_configs, plot_rows

from vllm_omni_kv.testing.engine_proc import EngineProc

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("omnikv_one_copy", "omnikv_packed", "recompute", "nixl_connector")


def write_model(out: Path, layers: int, v_heads: int, kv_heads: int) -> Path:
    """A random Qwen3-Next (full attention on every 4th layer) with the package's tiny
    tokenizer, written once (:func:`vllm_omni_kv.tiny_model.write_model_dir`)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from vllm_omni_kv.tiny_model import write_model_dir, write_tiny_model

    def build(tmp: Path) -> None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        cfg = Qwen3NextConfig(
            vocab_size=2048, hidden_size=512, intermediate_size=512, num_hidden_layers=layers,
            layer_types=kinds, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
            head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_num_key_heads=max(1, v_heads // 2),
            linear_num_value_heads=v_heads, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            decoder_sparse_step=1, max_position_embeddings=8192, bos_token_id=1,
            eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
        model.config.architectures = ["Qwen3NextForCausalLM"]
        model.save_pretrained(str(tmp), safe_serialization=True)

    return write_model_dir(out, build, write_tiny_model(out.parent / "state-bench-tokenizer"))


def page_geometry(a: Any) -> tuple[int, int, int, int, int]:
    """``(attention layers, state layers, state bytes, block size, attention page bytes)``:
    vLLM 0.32 makes an attention page hold a state page: its block size is the smallest
    multiple of the kernel alignment (128 on CPU, vLLM's default block size there) whose page
    is at least the state page (``vllm/platforms/interface.py``)."""
    attn = sum(1 for i in range(a.layers) if i % 4 == 3)
    k_heads, dim = max(1, a.v_heads // 2), 128
    conv = 3 * (2 * k_heads * dim + a.v_heads * dim) * 2  # (kernel - 1) x conv dim, bfloat16
    state = conv + a.v_heads * dim * dim * 4  # float32 SSM state (mamba_ssm_cache_dtype)
    per_token = 2 * a.kv_heads * 128 * 2
    align = 128
    block = align * -(-state // (align * per_token))
    return attn, a.layers - attn, state, block, block * per_token


def expected_bytes(lengths: list[int], a: Any) -> int:
    attn, states, state, block, page = page_geometry(a)
    return sum(attn * -(-(n - 1) // block) * page + states * state for n in lengths)


def _configs(name: str, base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """Producer config, consumer config, and per-engine flags of a P/D configuration."""
    if name == "nixl_connector":
        return nixl_configs(base)
    extra = {"share_cache": name == "omnikv_one_copy"}
    ktc = {"kv_connector": "OmniKVConnector",
           "kv_connector_extra_config": {"backend": "shm", "backend_extra": extra}}  # fmt: skip
    prod = {**base, "kv_transfer_config": {**ktc, "kv_role": "kv_producer"}}
    cons = {**base, "kv_transfer_config": {**ktc, "kv_role": "kv_consumer",
                                           "kv_load_failure_policy": "fail"}}  # fmt: skip
    return prod, cons, {}


def run_recompute(base: dict[str, Any], prompts: list[list[int]], env: dict, a: Any) -> dict:
    """A plain engine prefilling the batch: the time P/D saves the consumer."""
    eng = EngineProc(base, env=env, log=a.logs / "recompute.log")
    try:
        eng.wait_ready(600)
        ttfts = []
        for i in range(a.repeats + 1):  # the first round warms the engine up
            t0 = time.perf_counter()
            generate_checked(eng, prompts, 1)
            if i:
                ttfts.append(time.perf_counter() - t0)
    finally:
        eng.stop()
    return {"ttft_s": statistics.median(ttfts), "ttft_samples": ttfts, "bytes_moved": 0}


def _summary(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    one, packed, rec = (rows.get(n, {}) for n in ("omnikv_one_copy", "omnikv_packed", "recompute"))
    out = {}
    if one.get("ttft_s") and rec.get("ttft_s"):
        out["ttft_one_copy_vs_recompute"] = round(one["ttft_s"] / rec["ttft_s"], 3)
    if one.get("ttft_s") and packed.get("ttft_s"):
        out["ttft_one_copy_vs_packed"] = round(one["ttft_s"] / packed["ttft_s"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--v-heads", type=int, default=4, help="GDN value heads (of 128)")
    ap.add_argument("--kv-heads", type=int, default=2, help="attention KV heads (of 128)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args(argv)
    a.logs = Path(tempfile.mkdtemp(prefix="state_bench_logs_"))
    from transformers import AutoTokenizer

    from vllm_omni_kv.tiny_model import prompt_text

    tag = f"qwen3-next-bench-{a.layers}l-v{a.v_heads}-kv{a.kv_heads}-v1"
    model = write_model(REPO / ".cache" / "tiny-models" / tag, a.layers, a.v_heads, a.kv_heads)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [list(tok(prompt_text(900 + i, a.prompt_tokens))["input_ids"][: a.prompt_tokens])
               for i in range(a.prompts)]  # fmt: skip
    lengths = [len(p) for p in prompts]
    base = {"model": str(model), "dtype": "bfloat16", "in_process": True, "block_size": None,
            "max_model_len": a.prompt_tokens + 64, "max_num_seqs": a.prompts,
            "max_num_batched_tokens": max(8192, sum(lengths)), "enable_prefix_caching": False,
            "mamba_ssm_cache_dtype": "float32"}  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING")
    rows: dict[str, dict[str, Any]] = {}
    for name in filter(None, a.configs.split(",")):
        try:
            if name == "recompute":
                rows[name] = run_recompute(base, prompts, env, a)
            else:
                got = measure_pair(name, _configs(name, base), prompts, env, a)
                rows[name] = {**got, "expected_bytes": expected_bytes(lengths, a)}
        except Exception as e:  # record why a configuration could not run
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "ttft_samples"}))
    attn, states, state, block, page = page_geometry(a)
    out = {"workload": {k: getattr(a, k) for k in ("prompts", "prompt_tokens", "layers",
                                                  "v_heads", "kv_heads", "repeats")},
           "geometry": {"attention_layers": attn, "state_layers": states, "state_bytes": state,
                        "block_size": block, "attention_page_bytes": page},
           "prompt_lengths": lengths, "results": rows, "summary": _summary(rows),
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": os.getloadavg(), "logs": str(a.logs)}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "state_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    plot_rows(rows, a.out / "state_bench.png",
              f"Qwen3-Next-shaped, {a.layers} layers ({states} GDN), {a.prompts} x {a.prompt_tokens} tokens")  # fmt: skip
    print(json.dumps(out["summary"]))


if __name__ == "__main__":
    main()
