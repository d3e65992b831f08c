"""Loopback self-test of the shared-memory backend (used by ``vllm-omni-kv doctor --selftest``)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
from vllm_omni_kv.wire.payload import KVCacheTransferData


def selftest() -> dict[str, Any]:
    """Round-trip an 8 MiB KV payload between two connectors; check bytes and cleanup."""
    ns = f"selftest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    k = torch.randn(1024, 8, 128, generator=torch.Generator().manual_seed(0))
    data = KVCacheTransferData("selftest", {"key_cache": [k], "value_cache": [k]}, [0], {})
    t0 = time.perf_counter()
    with (
        SharedMemoryConnector({"namespace": ns}) as tx,
        SharedMemoryConnector({"namespace": ns}) as rx,
    ):
        _ok, size, _ = tx.put("a", "b", "k", data)
        got = rx.get("a", "b", "k")
        if got is None:
            return {"ok": False, "detail": "payload not found after put"}
        same = torch.equal(got[0]["layer_blocks"]["key_cache"][0], k)
        del got
    ms = (time.perf_counter() - t0) * 1e3
    leftover = sorted(arena.namespace_files(ns))
    ok = same and not leftover
    return {
        "ok": ok,
        "detail": f"{size / 2**20:.1f} MiB round trip in {ms:.1f} ms, bit-exact={same}",
    }
