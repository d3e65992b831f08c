"""Tiny-model paths shared by tests (import this, not conftest: conftest names collide)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_omni_kv.tiny_model import TinyModelSpec, write_model_dir, write_tiny_model

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
#: its block size on this CPU and one block of one layer: 2 KV heads of 64, K and V, float32
GEMMA3_BLOCK = 32
GEMMA3_PAGE = 2 * GEMMA3_BLOCK * 2 * 64 * 4


def gemma3_blocks(n: int) -> int:
    """Blocks holding ``n`` tokens."""
    return -(-n // GEMMA3_BLOCK)


def gemma3_window_start(n: int) -> int:
    """The first block a sliding layer keeps after ``n`` tokens (vLLM's rule)."""
    return max(0, n - GEMMA3_WINDOW + 1) // GEMMA3_BLOCK


def gemma3_pages(n: int, local: int = 0) -> int:
    """Pages a load of tokens ``[local, n)`` moves: every full layer's from the local hit,
    every sliding layer's from the later of the hit and its window."""
    full = gemma3_blocks(n) - local // GEMMA3_BLOCK
    sliding = gemma3_blocks(n) - max(local // GEMMA3_BLOCK, gemma3_window_start(n))
    return (
        GEMMA3_LAYERS.count("full_attention") * full
        + GEMMA3_LAYERS.count("sliding_attention") * sliding
    )


def tiny_gemma3() -> Path:
    """A tiny random Gemma 3 (text-only, built with ``transformers``) with the tiny Llama's
    tokenizer: 4 layers, 2 KV heads of 64, float32; generated once into the cache."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def build(tmp: Path) -> None:
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
        model.save_pretrained(str(tmp), safe_serialization=True)

    return _write_atomic(MODEL_CACHE / "gemma3-tiny-v1", build)


def _write_atomic(out: Path, build: Any) -> Path:
    """A model built by ``build(dir)`` at ``out`` with the tiny Llama's tokenizer, written
    once and renamed into place (:func:`vllm_omni_kv.tiny_model.write_model_dir`)."""
    return write_model_dir(out, build, tiny_model())


#: the tiny Qwen3-Next's layers: gated delta net (linear attention) on 0-2, full attention on 3
QWEN3_NEXT_LAYERS = ("linear_attention",) * 3 + ("full_attention",)


def tiny_qwen3_next() -> Path:
    """A tiny random Qwen3-Next (built with ``transformers``): 3 gated-delta-net layers
    (one key and one value head of 128: vLLM's CPU GDN kernel needs 128) and one
    full-attention layer (2 KV heads of 64), a 4-expert MoE, bfloat16."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    def build(tmp: Path) -> None:
        cfg = Qwen3NextConfig(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=len(QWEN3_NEXT_LAYERS),
            layer_types=list(QWEN3_NEXT_LAYERS),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            tie_word_embeddings=False,
            initializer_range=0.1,  # peaked logits: fewer bfloat16 near ties than 0.02's
        )
        torch.manual_seed(0)
        model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
        model.config.architectures = ["Qwen3NextForCausalLM"]
        model.save_pretrained(str(tmp), safe_serialization=True)

    return _write_atomic(MODEL_CACHE / "qwen3-next-tiny-v2", build)


#: the tiny Granite 4.0-H's layers: Mamba2 on 0, 1 and 3, full attention on 2
GRANITE_HYBRID_LAYERS = ("linear_attention",) * 2 + ("full_attention", "linear_attention")


def tiny_granite_hybrid() -> Path:
    """A tiny random GraniteMoeHybrid (Granite 4.0-H: Mamba2 and attention, built with
    ``transformers``): 3 Mamba2 layers (4 heads of 32, state 64, one group) and one
    full-attention layer (2 KV heads of 32), a 4-expert MoE with a shared expert, float32."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    def build(tmp: Path) -> None:
        cfg = GraniteMoeHybridConfig(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=128,
            shared_intermediate_size=128,
            num_hidden_layers=len(GRANITE_HYBRID_LAYERS),
            layer_types=list(GRANITE_HYBRID_LAYERS),
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_head=32,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=128,
            position_embedding_type="rope",
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            tie_word_embeddings=True,
            initializer_range=0.1,  # peaked logits: fewer near ties than 0.02's
        )
        torch.manual_seed(0)
        model = GraniteMoeHybridForCausalLM(cfg).to(torch.float32)
        model.config.architectures = ["GraniteMoeHybridForCausalLM"]
        model.save_pretrained(str(tmp), safe_serialization=True)

    return _write_atomic(MODEL_CACHE / "granite-hybrid-tiny-v3", build)


#: the tiny LFM2's layers: gated short convolution on 0, 1 and 3, full attention on 2
LFM2_LAYERS = ("conv",) * 2 + ("full_attention", "conv")


def tiny_lfm2() -> Path:
    """A tiny random LFM2 (gated short convolutions and attention, built with
    ``transformers``): 3 short-conv layers (kernel 3, state (2, 256)) and one
    full-attention layer (2 KV heads of 64), float32."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    def build(tmp: Path) -> None:
        cfg = Lfm2Config(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=len(LFM2_LAYERS),
            layer_types=list(LFM2_LAYERS),
            num_attention_heads=4,
            num_key_value_heads=2,
            conv_L_cache=3,
            conv_bias=False,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            block_dim=256,  # vLLM reads these two (real LFM2 configs carry them)
            conv_dim=256,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            tie_word_embeddings=True,
            initializer_range=0.1,  # peaked logits: fewer near ties than 0.02's
        )
        torch.manual_seed(0)
        model = Lfm2ForCausalLM(cfg).to(torch.float32)
        model.config.architectures = ["Lfm2ForCausalLM"]
        model.save_pretrained(str(tmp), safe_serialization=True)

    return _write_atomic(MODEL_CACHE / "lfm2-tiny-v1", build)
