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
    "NixlConnector": ("vllm_omni_kv.backends.nixl.connector", "NixlConnector"),
    "CudaIpcConnector": ("vllm_omni_kv.backends.cuda_ipc.connector", "CudaIpcConnector"),
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
    "nixl": "NixlConnector",
    "cuda_ipc": "CudaIpcConnector",
}


#: backends with a ``role`` setting (``sender`` / ``receiver`` / ``dual``), by registered name
ROLE_BACKENDS: frozenset[str] = frozenset(
    {"MooncakeTransferEngineConnector", "YuanrongTransferEngineConnector", "NixlConnector"}
)
#: the backend role each vLLM ``kv_role`` needs
ROLE_FOR_KV_ROLE: dict[str, str] = {
    "kv_producer": "sender",
    "kv_consumer": "receiver",
    "kv_both": "dual",
}
#: backend roles able to do what a ``kv_role`` asks (send, receive, or both)
_ROLES_ABLE: dict[str, tuple[str, ...]] = {
    "kv_producer": ("sender", "dual"),
    "kv_consumer": ("receiver", "dual"),
    "kv_both": ("dual",),
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


def with_role_for(spec: ConnectorSpec, kv_role: str | None) -> ConnectorSpec:
    """``spec`` with its ``role`` following vLLM's ``kv_role`` when it has none.

    Only backends in :data:`ROLE_BACKENDS` take a role. An explicit role that cannot do
    what ``kv_role`` asks (a ``receiver`` in a ``kv_producer``) is a :class:`ConfigError`.
    """
    name = OmniConnectorFactory.resolve_name(spec.name)
    if name not in ROLE_BACKENDS or kv_role is None or kv_role not in ROLE_FOR_KV_ROLE:
        return spec
    role = spec.extra.get("role")
    if role is None:
        return ConnectorSpec(spec.name, {**spec.extra, "role": ROLE_FOR_KV_ROLE[kv_role]})
    if role not in _ROLES_ABLE[kv_role]:
        raise ConfigError(
            f"backend role {role!r} cannot serve kv_role {kv_role!r}: use "
            f"{' or '.join(repr(r) for r in _ROLES_ABLE[kv_role])}, or leave 'role' out "
            f"(it then follows kv_role: {ROLE_FOR_KV_ROLE[kv_role]!r})"
        )
    return spec
