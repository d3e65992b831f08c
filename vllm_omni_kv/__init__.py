"""vllm-omni-kv: KV-cache transfer between disaggregated vLLM stages.

Importing this package is cheap and has no side effects: the public names
below are resolved lazily on first attribute access, so vLLM processes that
load the plugin entry point do not pay for torch/zmq imports they never use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # errors
    "OmniKVError": "vllm_omni_kv.errors",
    "KVPayloadError": "vllm_omni_kv.errors",
    "KVTransferTimeout": "vllm_omni_kv.errors",
    "BackendUnavailable": "vllm_omni_kv.errors",
    "ConfigError": "vllm_omni_kv.errors",
    "KVTransferError": "vllm_omni_kv.errors",
    "KVTransferCancelled": "vllm_omni_kv.errors",
    # transfer core
    "KVCacheTransferData": "vllm_omni_kv.wire.payload",
    "LayerKV": "vllm_omni_kv.kvcache.kv_utils",
    "OmniKVCacheConfig": "vllm_omni_kv.transfer.manager",
    "OmniKVTransferManager": "vllm_omni_kv.transfer.manager",
    "ConnectorSpec": "vllm_omni_kv.backends.spec",
    "OmniTransferConfig": "vllm_omni_kv.backends.spec",
    "load_omni_transfer_config": "vllm_omni_kv.backends.spec",
    # backends
    "OmniConnectorBase": "vllm_omni_kv.backends.base",
    "OmniConnectorFactory": "vllm_omni_kv.backends.factory",
    "SharedMemoryConnector": "vllm_omni_kv.backends.shm.connector",
    "ShmInventory": "vllm_omni_kv.backends.shm.inventory",
    "shm_inventory": "vllm_omni_kv.backends.shm.inventory",
    "MooncakeTransferEngineConnector": "vllm_omni_kv.backends.pull.mooncake",
    "MooncakeStoreConnector": "vllm_omni_kv.backends.mooncake_store.connector",
    "MooncakeConnector": "vllm_omni_kv.backends.mooncake_store.connector",
    "YuanrongConnector": "vllm_omni_kv.backends.yuanrong.datasystem",
    "YuanrongTransferEngineConnector": "vllm_omni_kv.backends.pull.yuanrong",
    "ManagedBuffer": "vllm_omni_kv.backends.pool",
    "BufferAllocator": "vllm_omni_kv.backends.pool",
    # vLLM connector
    "OmniKVConnector": "vllm_omni_kv.connector.omni_kv_connector",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_omni_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from vllm_omni_kv.backends.base import OmniConnectorBase
    from vllm_omni_kv.backends.factory import OmniConnectorFactory
    from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
    from vllm_omni_kv.backends.shm.inventory import ShmInventory, shm_inventory
    from vllm_omni_kv.backends.spec import (
        ConnectorSpec,
        OmniTransferConfig,
        load_omni_transfer_config,
    )
    from vllm_omni_kv.errors import (
        BackendUnavailable,
        ConfigError,
        KVPayloadError,
        KVTransferCancelled,
        KVTransferError,
        KVTransferTimeout,
        OmniKVError,
    )
    from vllm_omni_kv.kvcache.kv_utils import LayerKV
    from vllm_omni_kv.transfer.manager import OmniKVCacheConfig, OmniKVTransferManager
    from vllm_omni_kv.wire.payload import KVCacheTransferData
