"""The compatibility identity (``connector/compat.py``): equal for the same model under
another path, different for other weights, and enforced on every payload."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_omni_kv.connector import compat
from vllm_omni_kv.connector.compat import COMPAT_KEY, engine_compat, weights_fingerprint
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


def test_large_weight_files_are_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files above FULL_HASH_BYTES: size, header and evenly spaced slices decide."""
    monkeypatch.setattr(compat, "FULL_HASH_BYTES", 1 << 10)
    monkeypatch.setattr(compat, "SAMPLE_BYTES", 256)
    monkeypatch.setattr(compat, "SAMPLES", 8)
    w = tmp_path / "model.bin"
    data = bytearray(range(256)) * 256  # 64 KiB
    w.write_bytes(data)
    base = weights_fingerprint(tmp_path)
    data[0] ^= 1  # inside the first sample
    w.write_bytes(data)
    assert weights_fingerprint(tmp_path) != base
    data[0] ^= 1
    data[5000] ^= 1  # between samples: not seen (the documented trade-off)
    w.write_bytes(data)
    assert weights_fingerprint(tmp_path) == base


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
