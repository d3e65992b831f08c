"""The CPU paged-KV layout, checked against a live vLLM engine.

A vLLM producer (OmniKVConnector, stages "ar" -> "dit") prefills a prompt; this process,
without vLLM, receives the KV through OmniKVTransferManager and compares every layer's K
and V, token by token, with the same model run by `transformers`. This is what makes an
AR -> diffusion handoff correct: the diffusion stage needs real [seq, heads, dim] KV. The
producers are the suite's in-process test engines (one per dtype, started together); the
example's own AR stage script runs in test_demos.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _models import REPO, tiny_model

from vllm_omni_kv import OmniKVTransferManager
from vllm_omni_kv.tiny_model import TinyModelSpec

sys.path.insert(0, str(REPO / "tests" / "connector"))
from pd_helpers import NAMESPACE, EngineProc, engine_cfg, engines, omni_ktc  # noqa: E402

DTYPES = ["float32", "bfloat16"]
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


def _model(dtype: str) -> Path:
    return tiny_model(
        TinyModelSpec(
            num_layers=2,
            num_kv_heads=2,
            num_attention_heads=4,
            head_dim=64,
            hidden_size=256,
            dtype=dtype,
        )
    )


@pytest.fixture(scope="module")
def producers() -> Iterator[dict[str, EngineProc]]:
    """One producer engine per dtype, publishing to the "ar" -> "dit" stages."""
    ktc = omni_ktc("kv_producer", omni_from_stage="ar", omni_to_stage="dit")
    cfgs = [
        (f"layout-{d}", engine_cfg(_model(d), ktc, dtype=d, block_size=32, max_model_len=1024))
        for d in DTYPES
    ]
    with engines(*cfgs) as procs:
        yield dict(zip(DTYPES, procs, strict=True))


def _receive(key: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``(K, V)`` of the payload under ``key``, as the diffusion stage gets it."""
    cfg = SimpleNamespace(
        omni_kv_config={
            "connector_config": {"type": "SharedMemoryConnector", "namespace": NAMESPACE},
            "omni_from_stage": "ar",
            "omni_to_stage": "dit",
            "stage_id": "dit",
            "engine_input_source": ["ar"],
            "need_recv_cache": True,
            "recv_timeout": 30,
        }
    )
    with OmniKVTransferManager.from_od_config(cfg) as mgr:
        data, size = mgr.receive_kv_cache_for_request(key)
        assert data is not None and size > 0
        layers: Any = data["layer_blocks"]
        got = [
            (k.float().clone(), v.float().clone())
            for k, v in zip(layers["key_cache"], layers["value_cache"], strict=True)
        ]
        del data, layers
    return got


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_received_kv_matches_transformers(dtype: str, producers: dict[str, EngineProc]) -> None:
    from transformers import AutoTokenizer

    model_dir = _model(dtype)
    ids = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT)["input_ids"]
    r = producers[dtype].generate(
        [ids], max_tokens=1, kv_transfer_params=[{"do_remote_decode": True}]
    )
    assert "error" not in r, r
    got = _receive(r["outputs"][0]["kv_transfer_params"]["remote_transfer_id"])
    n, ref = _reference_kv(model_dir, PROMPT, getattr(torch, dtype))
    assert n == len(ids)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert len(got) == len(ref)
    for i, ((k, v), (rk, rv)) in enumerate(zip(got, ref, strict=True)):
        assert k.shape == rk.shape, f"layer {i}: {tuple(k.shape)} vs {tuple(rk.shape)}"
        scale = rk.float().abs().max().item()
        assert (k - rk.float()).abs().max().item() <= tol * max(scale, 1.0), f"layer {i} K differs"
        assert (v - rv.float()).abs().max().item() <= tol * max(scale, 1.0), f"layer {i} V differs"
