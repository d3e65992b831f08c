"""``YuanrongTransferEngineConnector``: the pull connector of
:mod:`vllm_omni_kv.backends.pull.pull` over the Yuanrong transfer engine.

The engine is ``yr.datasystem.TransferEngine`` (``initialize("host:port", protocol,
device_name)``, ``register_memory``, ``transfer_sync_read``, ``finalize``; each
returns a ``Status``) from package ``openyuanrong-transfer-engine``. Config as for
Mooncake TE plus ``rpc_port`` (the engine listens on it; default: a free port),
with Ascend defaults ``protocol='ascend'``, ``memory_pool_device='npu'``,
``device_name='npu:0'``.

Verified on a CPU-only host: the engine imports, ``initialize('127.0.0.1:PORT',
'tcp', 'npu:0')`` and ``register_memory`` of host memory succeed, and every
transfer fails with "p2p-transfer library not loaded: libascendcl.so": its data
path needs Ascend CANN and NPUs, so no round trip could run here.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from vllm_omni_kv.backends.net import free_port
from vllm_omni_kv.backends.pull.pull import EngineAdapter, PullTransferConnector
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError

TRANSFER_ENGINE_PACKAGE = "openyuanrong-transfer-engine"


def import_transfer_engine() -> Any:
    """``yr.datasystem.TransferEngine``, or ``BackendUnavailable`` naming the package."""
    try:
        import yr.datasystem as ds

        engine = ds.TransferEngine
    except (ImportError, AttributeError) as e:
        raise BackendUnavailable(
            f"YuanrongTransferEngineConnector needs the Yuanrong transfer engine ({e}); "
            f"install it with: pip install {TRANSFER_ENGINE_PACKAGE} (Ascend hosts with CANN)"
        ) from e
    return engine


def _check(status: Any, what: str) -> None:
    if not status.is_ok():
        raise KVTransferError(f"Yuanrong transfer engine {what} failed: {status.to_string()}")


class YuanrongEngine:
    """Adapter from ``yr.datasystem.TransferEngine`` to :class:`EngineAdapter`."""

    def __init__(self, host: str, rpc_port: int, protocol: str, device_name: str) -> None:
        engine_cls = import_transfer_engine()
        self.engine = engine_cls()
        self.session = f"{host}:{rpc_port}"
        status = self.engine.initialize(self.session, protocol, device_name)
        if not status.is_ok():
            raise BackendUnavailable(
                f"Yuanrong TransferEngine.initialize({self.session!r}, {protocol!r}, "
                f"{device_name!r}) failed: {status.to_string()}"
            )

    def register(self, addr: int, size: int) -> None:
        _check(self.engine.register_memory(addr, size), f"register_memory({addr:#x}, {size})")

    def register_device(self, addr: int, size: int, device: str) -> None:
        """Memory of ``device`` (the engine moves that of the device it was initialized
        for: NPU memory on Ascend, its default pool)."""
        self.register(addr, size)

    def unregister(self, addr: int) -> None:
        _check(self.engine.unregister_memory(addr), "unregister_memory")

    def read(self, session: str, local_addr: int, remote_addr: int, length: int) -> None:
        status = self.engine.transfer_sync_read(session, local_addr, remote_addr, length)
        _check(status, f"transfer_sync_read of {length} bytes from {session}")

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.finalize()
            finally:
                self.engine = None


class YuanrongTransferEngineConnector(PullTransferConnector):
    """Pull-based connector backed by the Yuanrong transfer engine (Ascend NPUs)."""

    backend_name = "yuanrong_te"
    CONFIG_KEYS: ClassVar[frozenset[str]] = PullTransferConnector.CONFIG_KEYS | {
        "protocol",
        "device_name",
        "rpc_port",
    }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = {
            "protocol": "ascend",
            "memory_pool_device": "npu",
            "device_name": "npu:0",
            **{
                k: os.path.expandvars(v) if isinstance(v, str) else v
                for k, v in (config or {}).items()
            },
        }
        import_transfer_engine()  # fail fast, before any pool is allocated
        super().__init__(cfg)

    def _make_engine(self) -> EngineAdapter:
        port = self.config.get("rpc_port")
        return YuanrongEngine(
            self.host,
            int(port) if port else free_port(self.host),
            str(self.config["protocol"]),
            str(self.config["device_name"]),
        )
