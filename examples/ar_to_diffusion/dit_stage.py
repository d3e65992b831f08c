"""Diffusion stage: no vLLM engine. Receives the AR stage's KV (and the negative prompt's,
as a CFG companion) through OmniKVTransferManager, then denoises with cross-attention
into that KV and writes a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from denoiser import build, sample, save_png

from vllm_omni_kv import OmniKVTransferManager


def stage_config(namespace: str, timeout: float) -> SimpleNamespace:
    """The stage config a vllm-omni diffusion stage carries, unchanged."""
    return SimpleNamespace(
        stage_id="dit",
        omni_kv_config={
            "connector_config": {"type": "SharedMemoryConnector", "namespace": namespace},
            "omni_from_stage": "ar",
            "omni_to_stage": "dit",
            "stage_id": "dit",
            "engine_input_source": ["ar"],
            "need_recv_cache": True,
            "recv_timeout": timeout,
        },
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positive", required=True, help="request id of the prompt's KV")
    ap.add_argument("--negative", required=True, help="request id of the negative prompt's KV")
    ap.add_argument("--namespace", default="ar2dit")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()

    mgr = OmniKVTransferManager.from_od_config(stage_config(a.namespace, a.timeout))
    timings: dict[str, Any] = {}

    def collect_cfg(
        request_id: str, cfg_ids: list[str], manager: Any, device: Any
    ) -> dict[str, Any]:
        t = time.perf_counter()
        got = {i: manager.receive_kv_cache_for_request(i, device) for i in cfg_ids}
        timings["negative_recv_ms"] = (time.perf_counter() - t) * 1e3
        timings["negative_bytes"] = sum(size for _d, size in got.values())
        return {"cfg_kv": {i: d for i, (d, _s) in got.items()}}

    req = SimpleNamespace(
        request_id=a.positive, sampling_params=SimpleNamespace(cfg_kv_request_ids=[a.negative])
    )
    t0 = time.perf_counter()
    if not mgr.receive_multi_kv_cache(req, collect_cfg):
        print(f"ERROR: no KV for request {a.positive} within {a.timeout}s", file=sys.stderr)
        return 1
    timings["total_recv_ms"] = (time.perf_counter() - t0) * 1e3
    neg = req.sampling_params.cfg_kv[a.negative]
    if neg is None:
        print(f"ERROR: no KV for the negative prompt {a.negative}", file=sys.stderr)
        return 1
    pos_kv = list(zip(req.past_key_values.key_cache, req.past_key_values.value_cache, strict=True))
    neg_kv = list(
        zip(neg["layer_blocks"]["key_cache"], neg["layer_blocks"]["value_cache"], strict=True)
    )
    seq, heads, head_dim = pos_kv[0][0].shape
    model = build(len(pos_kv), heads, head_dim)
    t1 = time.perf_counter()
    img = sample(model, pos_kv, neg_kv, steps=a.steps)
    timings["denoise_ms"] = (time.perf_counter() - t1) * 1e3
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save_png(img, str(a.out))
    result = {
        "png": str(a.out),
        "layers": len(pos_kv),
        "prompt_tokens": int(seq),
        "negative_tokens": int(neg_kv[0][0].shape[0]),
        "kv_heads": int(heads),
        "head_dim": int(head_dim),
        "vllm_imported": "vllm" in sys.modules,
        "image_mean": float(img.mean()),
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()},
    }
    print("RESULT " + json.dumps(result), flush=True)
    del req, neg, pos_kv, neg_kv
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
