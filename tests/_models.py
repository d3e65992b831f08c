"""Tiny-model paths shared by tests (import this, not conftest: conftest names collide)."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_omni_kv.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
MODEL_CACHE = Path(os.environ.get("OMNIKV_MODEL_CACHE", REPO / ".cache" / "tiny-models"))


def tiny_model(spec: TinyModelSpec | None = None) -> Path:
    """The tiny model for ``spec`` (default spec), generated once into the cache."""
    spec = spec or TinyModelSpec()
    return write_tiny_model(MODEL_CACHE / f"llama-{spec.fingerprint()}", spec)


#: the tiny Gemma 3's attention: a sliding window of 64 tokens on layers 0-2, every token
#: on layer 3 (vLLM's hybrid KV cache manager gives each its own KV cache group)
GEMMA3_WINDOW = 64
GEMMA3_LAYERS = ("sliding_attention",) * 3 + ("full_attention",)


def tiny_gemma3() -> Path:
    """A tiny random Gemma 3 (text-only, built with ``transformers``) with the tiny Llama's
    tokenizer: 4 layers, 2 KV heads of 64, float32; generated once into the cache."""
    import shutil

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = MODEL_CACHE / "gemma3-tiny-v1"
    if (out / ".done").exists():
        return out
    cfg = Gemma3TextConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(GEMMA3_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=GEMMA3_WINDOW,
        layer_types=list(GEMMA3_LAYERS),
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    model.config.architectures = ["Gemma3ForCausalLM"]
    model.save_pretrained(str(out), safe_serialization=True)
    llama = tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(llama / name, out / name)
    (out / ".done").write_text("")
    return out
