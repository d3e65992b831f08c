"""The compatibility identity (``connector/compat.py``): equal for the same model under
another path, different for other weights, and enforced on every payload. The weights'
digest cache is covered in ``test_weights_digest.py``."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_omni_kv.connector.compat import COMPAT_KEY, engine_compat
from vllm_omni_kv.connector.metadata import LoadSpec
from vllm_omni_kv.connector.receive import check_payload
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.tiny_model import TinyModelSpec, _write_weights


def _vllm_config(model_dir: Path) -> SimpleNamespace:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    model = SimpleNamespace(
        model=str(model_dir), tokenizer=str(model_dir), hf_config=hf, dtype="float32"
    )
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight digests are cached under this test's directory, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def other_weights(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The same architecture, config and tokenizer with weights from another seed."""
    d = tmp_path / "other"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    _write_weights(d, TinyModelSpec(seed=7))
    return d


def test_same_model_under_another_path_is_compatible(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_model_dir, copy)
    a, b = engine_compat(_vllm_config(tiny_model_dir)), engine_compat(_vllm_config(copy))
    assert a.fields == b.fields
    assert a.fields["weights"] not in ("none", "unknown")
    assert a.fields["architecture"] == "LlamaForCausalLM"


def test_other_weights_are_named_as_the_difference(
    tiny_model_dir: Path, other_weights: Path
) -> None:
    a, b = engine_compat(_vllm_config(tiny_model_dir)), engine_compat(_vllm_config(other_weights))
    diffs = a.differences(b.to_dict())
    assert len(diffs) == 1 and diffs[0].startswith("weights")
    assert a.differences(None) == ["the producer sent no compatibility identity"]


def _tensor_bytes(path: Path, name: str) -> tuple[int, int]:
    """``[start, end)`` file offsets of tensor ``name`` in a safetensors file (read from
    its header here, as the format defines it)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def test_a_twin_differing_in_one_k_proj_byte_is_named_as_the_difference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    twin = tmp_path / "twin"
    shutil.copytree(tiny_model_dir, twin)
    weights = twin / "model.safetensors"
    start, end = _tensor_bytes(weights, "model.layers.1.self_attn.k_proj.weight")
    raw = bytearray(weights.read_bytes())
    raw[(start + end) // 2] ^= 0x01  # one bit of one element
    weights.write_bytes(raw)
    a, b = engine_compat(_vllm_config(tiny_model_dir)), engine_compat(_vllm_config(twin))
    diffs = a.differences(b.to_dict())
    assert len(diffs) == 1 and diffs[0].startswith("weights"), diffs


def test_payloads_from_an_incompatible_engine_are_refused(
    tiny_model_dir: Path, other_weights: Path
) -> None:
    mine = engine_compat(_vllm_config(tiny_model_dir))
    theirs = engine_compat(_vllm_config(other_weights))
    spec = LoadSpec("r", "t", [0], 0, 10, 10, "dg")

    def payload(ident: dict[str, str] | None) -> dict[str, object]:
        md: dict[str, object] = {
            "prompt_digest": "dg",
            "format": "token_major",
            "num_tokens": 10,
            "block_size": 32,
            "rows": 10,
            "num_layers": 1,
        }
        if ident is not None:
            md[COMPAT_KEY] = ident
        return {"metadata": md}

    check_payload(payload(mine.to_dict()), spec, 32, mine)
    with pytest.raises(KVPayloadError, match=r"incompatible engine.*weights \(producer"):
        check_payload(payload(theirs.to_dict()), spec, 32, mine)
    with pytest.raises(KVPayloadError, match="sent no compatibility identity"):
        check_payload(payload(None), spec, 32, mine)
