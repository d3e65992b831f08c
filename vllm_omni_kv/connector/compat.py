"""The compatibility identity of an engine: what must match for a producer's KV to mean the
same thing in a consumer.

Computed once when the worker starts and sent in every payload's metadata; a consumer
compares it with its own before it writes a byte, and a mismatch fails the load with
the fields that differ (vLLM then recomputes). Fields: the model architecture and a
digest of its config (paths and version stamps left out), a digest of the tokenizer
files, a fingerprint of the weights, the model and KV cache dtypes, and the vLLM and
payload format versions. The weights fingerprint covers every byte of every weight
file (each file's xxh3-128, cached per file across restarts by
:mod:`~vllm_omni_kv.connector.weights_digest`) and is equal for the same weights under
any path. The cache layout is compared separately by the paged-blocks format, which
converts between layouts where that is lossless; the block size and TP sizes by the
load itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_kv.connector.weights_digest import DigestCache, file_digests
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.prelude import VERSION as FRAME_VERSION

logger = init_logger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
#: config keys that say where or with what a model was saved, not what it computes
_CONFIG_NOISE = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"}
#: metadata key of the identity in a payload
COMPAT_KEY = "compat"


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def weights_fingerprint(model_dir: Path, cache: DigestCache | None = None) -> str:
    """A digest of every byte of the weight files in ``model_dir`` (names do not matter,
    contents do); per-file digests come through ``cache`` (default: the user's cache)."""
    files = sorted(
        (p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()),
        key=lambda p: p.name,
    )
    if not files:
        return "none"
    digests = file_digests(files, cache if cache is not None else DigestCache.default())
    return _digest(bytes.fromhex(d) for d in digests)


def tokenizer_digest(tokenizer_dir: Path) -> str:
    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not files:
        return "none"
    return _digest(n.name.encode() + n.read_bytes() for n in files)


def config_digest(config: dict[str, Any]) -> str:
    clean = {k: v for k, v in config.items() if k not in _CONFIG_NOISE}
    return _digest([json.dumps(clean, sort_keys=True, default=str).encode()])


@dataclass(frozen=True)
class CompatIdentity:
    """What must be equal between producer and consumer (each field a short string)."""

    fields: dict[str, str]

    def to_dict(self) -> dict[str, str]:
        return dict(self.fields)

    def differences(self, other: Any) -> list[str]:
        """Fields where a payload's identity ``other`` (a mapping) differs from ours."""
        if not isinstance(other, dict):
            return ["the producer sent no compatibility identity"]
        out = []
        for k, mine in self.fields.items():
            theirs = other.get(k)
            if theirs != mine:
                out.append(f"{k} (producer {theirs!r}, this engine {mine!r})")
        return out


def _local_dir(name_or_path: str | None, revision: str | None) -> Path | None:
    if not name_or_path:
        return None
    p = Path(name_or_path)
    if p.is_dir():
        return p
    try:  # a hub id: the snapshot vLLM loaded, from the local cache only
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, revision=revision, local_files_only=True))
    except Exception:
        return None


def engine_compat(vllm_config: Any) -> CompatIdentity:
    """The identity of the engine ``vllm_config`` describes (reads config, tokenizer and
    weight files once)."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    hf = getattr(model, "hf_config", None)
    try:
        config = hf.to_dict() if hf is not None else {}
    except Exception:
        config = {}
    revision = getattr(model, "revision", None)
    model_dir = _local_dir(getattr(model, "model", None), revision)
    tok_dir = _local_dir(getattr(model, "tokenizer", None), revision) or model_dir
    if model_dir is None:
        logger.warning(
            "OmniKVConnector: model %r is not a local directory, so its weights are not "
            "fingerprinted: producer and consumer are checked by config and tokenizer only",
            getattr(model, "model", None),
        )
    try:
        import vllm

        vllm_version = ".".join(str(vllm.__version__).split(".")[:2])
    except Exception:
        vllm_version = "unknown"
    fields = {
        "architecture": ",".join(config.get("architectures") or [str(config.get("model_type"))]),
        "config": config_digest(config),
        "tokenizer": tokenizer_digest(tok_dir) if tok_dir else "unknown",
        "weights": weights_fingerprint(model_dir) if model_dir else "unknown",
        "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "vllm": vllm_version,
        "payload_version": str(FRAME_VERSION),
    }
    return CompatIdentity(fields)
