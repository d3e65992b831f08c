"""Registry of omni-connector backends, keyed by name, and the check of their settings.

Every built-in backend class declares the settings it reads as ``CONFIG_KEYS``;
:meth:`OmniConnectorFactory.check_config` rejects any other key (a typo such as
``share_cahce`` fails instead of silently meaning the default), naming the nearest valid
one. A registered constructor without ``CONFIG_KEYS`` takes any key.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.spec import ConnectorSpec, check_keys
from vllm_omni_kv.errors import ConfigError

Constructor = Callable[[dict[str, Any]], OmniConnectorBase]

# Built-in backends: name -> (module, class). Imported only when created.
_BUILTIN: dict[str, tuple[str, str]] = {
    "SharedMemoryConnector": ("vllm_omni_kv.backends.shm.connector", "SharedMemoryConnector"),
    "MooncakeTransferEngineConnector": (
        "vllm_omni_kv.backends.pull.mooncake",
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
    "NixlPullConnector": ("vllm_omni_kv.backends.nixl.connector", "NixlPullConnector"),
    "CudaIpcConnector": ("vllm_omni_kv.backends.cuda_ipc.connector", "CudaIpcConnector"),
    "YuanrongTransferEngineConnector": (
        "vllm_omni_kv.backends.pull.yuanrong",
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
    "nixl": "NixlPullConnector",
    "cuda_ipc": "CudaIpcConnector",
}


#: backends with a ``role`` setting (``sender`` / ``receiver`` / ``dual``), by registered name
ROLE_BACKENDS: frozenset[str] = frozenset(
    {"MooncakeTransferEngineConnector", "YuanrongTransferEngineConnector", "NixlPullConnector"}
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


#: keys the vLLM connector or a vllm-omni stage config adds to any backend's settings,
#: accepted by every backend: ``local_rank`` (the worker's TP rank), ``role`` (vllm-omni
#: names one for every connector; only the role backends read it), ``auth_key`` (the
#: loaded shared secret of ``auth_key_file``)
INJECTED_KEYS: frozenset[str] = frozenset({"local_rank", "role", "auth_key"})


class _Lazy:
    """Constructor of a built-in backend; its module is imported on first use."""

    def __init__(self, module: str, cls: str) -> None:
        self.module, self.cls = module, cls

    def backend_class(self) -> type[OmniConnectorBase]:
        klass: type[OmniConnectorBase] = getattr(importlib.import_module(self.module), self.cls)
        return klass

    def __call__(self, config: dict[str, Any]) -> OmniConnectorBase:
        klass: Any = self.backend_class()  # every backend class takes its config
        instance: OmniConnectorBase = klass(config)
        return instance


class OmniConnectorFactory:
    """Factory for creating omni connectors by registered name."""

    _registry: dict[str, Constructor] = {n: _Lazy(m, c) for n, (m, c) in _BUILTIN.items()}
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
        cls.check_config(spec, f"omni connector {spec.name!r} extra")
        return ctor(dict(spec.extra))

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str] | None:
        """The settings backend ``name`` (or an alias) reads: its class's ``CONFIG_KEYS``
        (without :data:`INJECTED_KEYS`); None for an unknown name or an undeclared set."""
        ctor = cls._registry.get(cls.resolve_name(name))
        owner = ctor.backend_class() if isinstance(ctor, _Lazy) else ctor
        keys = getattr(owner, "CONFIG_KEYS", None)
        return keys if isinstance(keys, frozenset) else None

    @classmethod
    def check_config(cls, spec: ConnectorSpec, where: str) -> None:
        """Raise :class:`ConfigError` (prefixed ``where``) for a key of ``spec.extra``
        that its backend does not read, naming the nearest valid key."""
        keys = cls.config_keys(spec.name)
        if keys is not None:
            check_keys(spec.extra, keys | INJECTED_KEYS, where, f" for backend {spec.name}", keys)

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
