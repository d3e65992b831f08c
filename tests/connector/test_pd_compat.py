"""Real engines: a consumer refuses KV from a producer serving other weights (same
architecture and tokenizer) and recomputes, accepts KV of the same weights loaded from
another path, and computes locally a request whose kv_transfer_params name a producer it
does not trust. Each consumer's own local run is the reference."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import engine_cfg, engines, make_prompts, omni_ktc

from vllm_omni_kv.tiny_model import TinyModelSpec, _write_weights

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compat")
    same = root / "same-weights-other-path"
    shutil.copytree(tiny_model_dir, same)
    other = root / "other-weights"
    shutil.copytree(tiny_model_dir, other)
    (other / "model.safetensors").unlink()
    _write_weights(other, TinyModelSpec(seed=7))
    return {"producer": tiny_model_dir, "same": same, "other": other}


@pytest.fixture(scope="module")
def pd(models: dict[str, Path]) -> Iterator[dict[str, Any]]:
    cons = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=10)
    with engines(
        ("compat-producer", engine_cfg(models["producer"], omni_ktc("kv_producer", backend="shm"))),
        ("compat-same", engine_cfg(models["same"], cons, enable_prefix_caching=False)),
        ("compat-other", engine_cfg(models["other"], cons, enable_prefix_caching=False)),
    ) as (prod, same, other):
        yield {"producer": prod, "same": same, "other": other}


def _decode(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    r = engine.generate(prompts, max_tokens=12, kv_transfer_params=params)
    assert "error" not in r, r
    return r


def _prefill(prod: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[PREFILL] * len(prompts))
    assert "error" not in r, r
    return [o["kv_transfer_params"] for o in r["outputs"]]


def test_compat_other_weights_refused_same_weights_accepted(
    pd: dict[str, Any], models: dict[str, Path]
) -> None:
    prompts = make_prompts(models["producer"], 2, seed=11)
    local = {
        k: [o["token_ids"] for o in _decode(pd[k], prompts, [None] * 2)["outputs"]]
        for k in ("same", "other")
    }
    assert local["same"] != local["other"], "the two models must answer differently"

    r = _decode(pd["same"], prompts, _prefill(pd["producer"], prompts))
    for o, want in zip(r["outputs"], local["same"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True, load
        assert o["token_ids"] == want

    r = _decode(pd["other"], prompts, _prefill(pd["producer"], prompts))
    for o, want in zip(r["outputs"], local["other"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and "weights" in load["error"], load
        assert o["token_ids"] == want  # recomputed with its own weights


def test_untrusted_producer_in_kv_transfer_params_is_computed_locally(
    pd: dict[str, Any], models: dict[str, Path]
) -> None:
    prompts = make_prompts(models["producer"], 1, seed=12)
    want = _decode(pd["same"], prompts, [None])["outputs"][0]["token_ids"]
    params = _prefill(pd["producer"], prompts)
    forged = [{**params[0], "remote_host": "203.0.113.9"}]  # a client's own endpoint
    r = _decode(pd["same"], prompts, forged)
    out = r["outputs"][0]
    assert out["token_ids"] == want
    assert not (out.get("kv_transfer_params") or {}).get("omni_kv_load")  # nothing loaded
    assert "not in kv_connector_extra_config.trusted_producers" in "\n".join(pd["same"].log_lines)
    # the producer still holds the payload: the genuine params load it
    r = _decode(pd["same"], prompts, params)
    assert r["outputs"][0]["kv_transfer_params"]["omni_kv_load"]["ok"] is True
    assert r["outputs"][0]["token_ids"] == want
