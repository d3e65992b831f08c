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
