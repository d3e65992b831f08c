"""Deterministic tiny Llama-architecture model, generated locally.

The weights are random (fixed seed) so the model speaks gibberish, but its
greedy tokens are deterministic: exactly what an equivalence test needs.
Nothing is downloaded. ``python -m vllm_omni_kv.tiny_model DIR``
writes one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

_WORDS = (
    "the of and to in is was for on that with as by at from his her they were "
    "this which be or are an had not but have one all their we been has there "
    "kv cache prefill decode stage token layer head block transfer memory shared "
    "engine request model diffusion image prompt latent noise step attention "
    "north river stone light garden quiet window paper orange silver market "
    "number system value signal vector matrix tensor batch queue socket buffer"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 25))) for _ in range(n_lines)]


def _write_tokenizer(path: Path, spec: TinyModelSpec) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=min(spec.vocab_size, 1024),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": spec.max_position_embeddings,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )
    vocab_len: int = tok.get_vocab_size()
    return vocab_len


def _write_weights(path: Path, spec: TinyModelSpec) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_kv_heads * hd

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(q_out, h)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_out, h)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_out, h)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, q_out)
        tensors[p + "mlp.gate_proj.weight"] = rand(spec.intermediate_size, h)
        tensors[p + "mlp.up_proj.weight"] = rand(spec.intermediate_size, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, spec.intermediate_size)
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _complete(out: Path, spec: TinyModelSpec) -> bool:
    marker = out / ".tiny_model.json"
    try:
        return json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint()
    except (OSError, ValueError):
        return False


def write_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny model directory at ``path`` (idempotent: skipped if already complete).
    The files are written into a temporary directory renamed into place, so processes
    writing the same model at once never read each other's partial files."""
    spec = spec or TinyModelSpec()
    out = Path(path)
    if _complete(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_files(tmp, spec)
        if out.exists() and not _complete(out, spec):
            shutil.rmtree(out, ignore_errors=True)  # a partial or older model
        try:
            os.rename(tmp, out)
        except OSError:
            if not _complete(out, spec):  # another process's model is in place otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_files(out: Path, spec: TinyModelSpec) -> None:
    tok_vocab = _write_tokenizer(out, spec)
    if tok_vocab > spec.vocab_size:
        raise ValueError(f"tokenizer vocab {tok_vocab} exceeds model vocab {spec.vocab_size}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2)
    )
    _write_weights(out, spec)
    (out / ".tiny_model.json").write_text(
        json.dumps({"fingerprint": spec.fingerprint(), "spec": asdict(spec)})
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model_dir(out: Path, build: Callable[[Path], None], tokenizer_from: Path) -> Path:
    """A model directory at ``out``, written once: ``build(dir)`` writes the model into a
    temporary sibling, the tokenizer files of ``tokenizer_from`` are added, and the
    directory is renamed into place (a half-written model is never seen)."""
    if (out / ".done").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_from / name, tmp / name)
        (tmp / ".done").write_text("")
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / ".done").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


#: CPU flags with native bfloat16 matrix multiplies (without them torch emulates bf16 matmuls,
#: about 7x slower than float32 on an AVX2-only machine)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def fast_cpu_dtype(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, str]:
    """The faster dtype for a tiny model on this CPU and why: ``bfloat16`` where the CPU
    multiplies it natively, else ``float32``."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return "float32", f"{cpuinfo} unreadable"
    native = [f for f in BF16_FLAGS if f in flags]
    if native:
        return "bfloat16", f"CPU has {', '.join(native)}"
    return "float32", f"CPU lacks {' and '.join(BF16_FLAGS)} (bfloat16 matmuls are emulated)"


def prompt_text(seed: int, n_words: int) -> str:
    """A deterministic prompt of ``n_words`` words from the tokenizer's corpus vocabulary."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=TinyModelSpec.num_layers)
    ap.add_argument("--kv-heads", type=int, default=TinyModelSpec.num_kv_heads)
    ap.add_argument("--heads", type=int, default=TinyModelSpec.num_attention_heads)
    ap.add_argument("--head-dim", type=int, default=TinyModelSpec.head_dim)
    ap.add_argument("--hidden", type=int, default=TinyModelSpec.hidden_size)
    ap.add_argument("--vocab", type=int, default=TinyModelSpec.vocab_size)
    ap.add_argument("--dtype", default=TinyModelSpec.dtype)
    ap.add_argument("--seed", type=int, default=TinyModelSpec.seed)
    a = ap.parse_args(argv)
    spec = TinyModelSpec(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab,
        dtype=a.dtype,
        seed=a.seed,
    )
    print(write_tiny_model(a.path, spec))


if __name__ == "__main__":
    main()
