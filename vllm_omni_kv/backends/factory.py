"""Registry of omni-connector backends, keyed by name."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import ConfigError

Constructor = Callable[[dict[str, Any]], OmniConnectorBase]

# Built-in backends: name -> (module, class). Imported only when created.
_BUILTIN: dict[str, tuple[str, str]] = {
    "SharedMemoryConnector": ("vllm_omni_kv.backends.shm.connector", "SharedMemoryConnector"),
    "MooncakeTransferEngineConnector": (
        "vllm_omni_kv.backends.transfer_engine.mooncake",
        "MooncakeTransferEngineConnector",
    ),
    "MooncakeStoreConnector": (
        "vllm_omni_kv.backends.mooncake_store.connector",
        "MooncakeStoreConnector",
    ),
    "MooncakeConnector": (
        "vllm_omni_kv.backends.mooncake_store.connector",
        "MooncakeStoreConnector",
    ),
    "YuanrongConnector": ("vllm_omni_kv.backends.yuanrong.datasystem", "YuanrongConnector"),
    "YuanrongTransferEngineConnector": (
        "vllm_omni_kv.backends.transfer_engine.yuanrong",
        "YuanrongTransferEngineConnector",
    ),
}

# Short aliases accepted in configs (``backend: shm``).
ALIASES: dict[str, str] = {
    "shm": "SharedMemoryConnector",
    "shared_memory": "SharedMemoryConnector",
    "mooncake": "MooncakeTransferEngineConnector",
    "mooncake_te": "MooncakeTransferEngineConnector",
    "mooncake_store": "MooncakeStoreConnector",
    "yuanrong": "YuanrongConnector",
    "yuanrong_te": "YuanrongTransferEngineConnector",
}


def _lazy(module: str, cls: str) -> Constructor:
    def construct(config: dict[str, Any]) -> OmniConnectorBase:
        klass = getattr(importlib.import_module(module), cls)
        instance: OmniConnectorBase = klass(config)
        return instance

    return construct


class OmniConnectorFactory:
    """Factory for creating omni connectors by registered name."""

    _registry: dict[str, Constructor] = {n: _lazy(m, c) for n, (m, c) in _BUILTIN.items()}
    _lock = threading.Lock()

    @classmethod
    def register_connector(cls, name: str, constructor: Constructor) -> None:
        """Register (or replace) a connector constructor under ``name``."""
        if not name or not callable(constructor):
            raise ConfigError("register_connector needs a non-empty name and a callable")
        with cls._lock:
            cls._registry[name] = constructor

    @classmethod
    def resolve_name(cls, name: str) -> str:
        """Map an alias (``shm``, ``mooncake``...) to its registered name."""
        return ALIASES.get(name, name)

    @classmethod
    def create_connector(cls, spec: ConnectorSpec) -> OmniConnectorBase:
        """Create a connector from ``spec``; unknown names raise ``ConfigError``."""
        name = cls.resolve_name(spec.name)
        ctor = cls._registry.get(name)
        if ctor is None:
            known = ", ".join(cls.list_registered_connectors())
            raise ConfigError(
                f"unknown omni connector {spec.name!r}; registered connectors: {known} "
                f"(aliases: {', '.join(sorted(ALIASES))})"
            )
        return ctor(dict(spec.extra))

    @classmethod
    def list_registered_connectors(cls) -> list[str]:
        """List all registered connector names."""
        return sorted(cls._registry)
