"""Self-test of the CUDA IPC backend (``doctor --selftest``): one GPU-to-GPU page move."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_kv.backends.shm.share_selftest import run


def selftest() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"ok": False, "detail": "no CUDA device in this process"}
    return run("cuda_ipc", "cuda")
