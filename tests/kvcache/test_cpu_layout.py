"""The CPU paged-KV layout, checked against a live vLLM engine.

A vLLM producer (OmniKVConnector) prefills a prompt; this process, without vLLM,
receives the KV through OmniKVTransferManager and compares every layer's K and V,
token by token, with the same model run by `transformers`. This is what makes an
AR -> diffusion handoff correct: the diffusion stage needs real [seq, heads, dim] KV.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _models import REPO, tiny_model

from vllm_omni_kv import OmniKVTransferManager
from vllm_omni_kv.tiny_model import TinyModelSpec

AR_STAGE = REPO / "examples" / "ar_to_diffusion" / "ar_stage.py"
#: the AR stage's engine core and worker in its one process (vLLM's InprocClient): one
#: interpreter start instead of two; the example's own layout runs in test_demos
IN_PROCESS_ENV = {
    **os.environ,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
}
PROMPT = "the prefill stage hands its cache to the decode engine over shared memory buffer"


def _reference_kv(
    model_dir: Path, prompt: str, dtype: torch.dtype
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        pkv = model(ids, use_cache=True).past_key_values
    layers = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in pkv.layers
    ]
    return int(ids.shape[1]), layers


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_received_kv_matches_transformers(dtype, request):
    spec = TinyModelSpec(
        num_layers=2,
        num_kv_heads=2,
        num_attention_heads=4,
        head_dim=64,
        hidden_size=256,
        dtype=dtype,
    )
    model_dir = tiny_model(spec)
    ns = f"layout-{dtype}-{id(request)}"
    ar = subprocess.Popen(
        [
            sys.executable,
            str(AR_STAGE),
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT,
            "--negative",
            "noise",
            "--namespace",
            ns,
            "--dtype",
            dtype,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=IN_PROCESS_ENV,
    )
    try:
        line = next((x for x in ar.stdout if x.startswith("READY ")), None)  # type: ignore[union-attr]
        assert line is not None, ar.stderr.read()[-3000:]  # type: ignore[union-attr]
        info = json.loads(line[len("READY ") :])
        cfg = SimpleNamespace(
            omni_kv_config={
                "connector_config": {"type": "SharedMemoryConnector", "namespace": ns},
                "omni_from_stage": "ar",
                "omni_to_stage": "dit",
                "stage_id": "dit",
                "engine_input_source": ["ar"],
                "need_recv_cache": True,
                "recv_timeout": 30,
            }
        )
        with OmniKVTransferManager.from_od_config(cfg) as mgr:
            data, size = mgr.receive_kv_cache_for_request(info["positive"])
            assert data is not None and size > 0
            got = [
                (k.float().clone(), v.float().clone())
                for k, v in zip(
                    data["layer_blocks"]["key_cache"],
                    data["layer_blocks"]["value_cache"],
                    strict=True,
                )
            ]
            neg, _ = mgr.receive_kv_cache_for_request(info["negative"])  # consume it: no leftovers
            assert neg is not None
            del data, neg
    finally:
        if ar.poll() is None:
            ar.stdin.write("done\n")  # type: ignore[union-attr]
            ar.stdin.flush()  # type: ignore[union-attr]
        try:
            ar.wait(60)
        except subprocess.TimeoutExpired:
            ar.kill()
    n, ref = _reference_kv(model_dir, PROMPT, getattr(torch, dtype))
    assert n == info["prompt_tokens"][0]
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert len(got) == len(ref)
    for i, ((k, v), (rk, rv)) in enumerate(zip(got, ref, strict=True)):
        assert k.shape == rk.shape, f"layer {i}: {tuple(k.shape)} vs {tuple(rk.shape)}"
        scale = rk.float().abs().max().item()
        assert (k - rk.float()).abs().max().item() <= tol * max(scale, 1.0), f"layer {i} K differs"
        assert (v - rv.float()).abs().max().item() <= tol * max(scale, 1.0), f"layer {i} V differs"
