"""``CudaIpcConnector``: shared-pages payloads over shared memory, pages copied GPU to GPU.

The shared-memory backend (:class:`~vllm_omni_kv.backends.shm.connector.SharedMemoryConnector`,
same settings) carries the small block-id payloads and their holds; the KV pages never
leave the GPUs: the producer's cache is exported through CUDA IPC
(:mod:`vllm_omni_kv.backends.cuda_ipc.region`) and a consumer on the same host copies the
pages it lacks device to device, opening the producer's allocation on its own GPU (one
GPU, or two with peer access). Registered as ``cuda_ipc`` (vllm-omni's
``CudaIpcConnector``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.backends.cuda_ipc.region import CudaIpcRegion
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
from vllm_omni_kv.errors import BackendUnavailable


class CudaIpcConnector(SharedMemoryConnector):
    """Shared memory for payloads, CUDA IPC for the KV cache itself."""

    TRANSPORT: ClassVar[str] = "cuda_ipc"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "CudaIpcConnector needs a CUDA device in this process; on a host without "
                "one use backend 'shm' with share_cache: true (one copy, cache to cache)"
            )
        super().__init__({**(config or {}), "share_cache": True})

    def _make_region(self) -> CacheRegion:
        return CudaIpcRegion(self.namespace, self._arena, self.stale_s)

    def health(self) -> dict[str, Any]:
        return {**super().health(), "backend": "cuda_ipc"}
