"""Yuanrong backends: ``YuanrongConnector`` (datasystem KV) and ``YuanrongTransferEngineConnector``.

``YuanrongConnector`` stores packed frames in an openYuanrong datasystem
worker through ``yr.datasystem.KVClient`` (``set`` / ``get`` with
``sub_timeout_ms`` / ``delete`` / ``health_check``); package
``openyuanrong-datasystem``. Config: ``host`` / ``port`` of the worker
(default 127.0.0.1:31501), ``connect_timeout_ms`` (60000),
``get_sub_timeout_ms`` (1000: how long ``get`` waits for a key),
``ttl_second`` (0: until deleted), ``write_mode`` (a ``WriteMode`` name,
default ``NONE_L2_CACHE``).

``YuanrongTransferEngineConnector`` is the pull-based connector of
:mod:`vllm_omni_kv.backends.pull_connector` over the Yuanrong transfer engine
(``yr.datasystem.TransferEngine``: ``initialize("host:port", protocol,
device_name)``, ``register_memory``, ``transfer_sync_read``, ``finalize``;
each returns a ``Status``); package ``openyuanrong-transfer-engine``. Config as
for Mooncake TE plus ``rpc_port`` (the engine listens on it; default: a free
port), with Ascend defaults ``protocol='ascend'``, ``memory_pool_device='npu'``,
``device_name='npu:0'``.

What was verified on a CPU-only host (packages unpacked outside the venv,
since both wheels ship ``yr/datasystem/__init__.py`` and the datasystem wheel
is ~33 MB): the transfer engine imports, ``initialize('127.0.0.1:PORT', 'tcp',
'npu:0')`` succeeds and ``register_memory`` of host memory succeeds, but every
transfer fails with "p2p-transfer library not loaded: libascendcl.so" -- its
data path needs Ascend CANN and NPUs, so no round trip could run here. The
datasystem ``KVClient`` imports and its ``init()`` fails cleanly (RuntimeError,
within ``connect_timeout_ms``) when no worker listens; a ``datasystem_worker``
(which needs an etcd/metastore cluster) was not started, so ``set``/``get``
were not exercised against a live worker.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.pull_connector import EngineAdapter, PullTransferConnector
from vllm_omni_kv.errors import BackendUnavailable, ConfigError, KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer import codec
from vllm_omni_kv.transfer.payload import KVCacheTransferData

logger = init_logger(__name__)

DATASYSTEM_PACKAGE = "openyuanrong-datasystem"
TRANSFER_ENGINE_PACKAGE = "openyuanrong-transfer-engine"


def import_kv_client() -> tuple[Any, Any]:
    """``(KVClient, WriteMode)`` from ``yr.datasystem``, or ``BackendUnavailable``."""
    try:
        from yr.datasystem import KVClient
        from yr.datasystem.object_client import WriteMode
    except ImportError as e:
        raise BackendUnavailable(
            f"YuanrongConnector needs the openYuanrong datasystem client ({e}); "
            f"install it with: pip install {DATASYSTEM_PACKAGE}"
        ) from e
    return KVClient, WriteMode


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
        from vllm_omni_kv.testing.net import free_port

        port = self.config.get("rpc_port")
        return YuanrongEngine(
            self.host,
            int(port) if port else free_port(self.host),
            str(self.config["protocol"]),
            str(self.config["device_name"]),
        )


class YuanrongConnector(OmniConnectorBase):
    """Datasystem-based distributed connector (frames stored in a Yuanrong worker)."""

    supports_raw_data = False

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._closed = True
        self.config = dict(config or {})
        kv_client_cls, write_mode_enum = import_kv_client()
        cfg = self.config
        try:
            self.host = str(cfg.get("host", "127.0.0.1"))
            self.port = int(cfg.get("port", 31501))
            self.get_sub_timeout_ms = max(0, int(cfg.get("get_sub_timeout_ms", 1000)))
            self.ttl_second = int(cfg.get("ttl_second", 0))
            connect_ms = int(cfg.get("connect_timeout_ms", 60000))
            self.write_mode = getattr(write_mode_enum, str(cfg.get("write_mode", "NONE_L2_CACHE")))
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"YuanrongConnector: bad setting: {e}") from None
        self.client: Any = kv_client_cls(self.host, self.port, connect_timeout_ms=connect_ms)
        try:
            self.client.init()
        except RuntimeError as e:
            self.client = None
            raise BackendUnavailable(
                f"cannot reach the Yuanrong datasystem worker at {self.host}:{self.port}: {e}"
            ) from e
        self._keys: set[str] = set()
        self._closed = False

    @staticmethod
    def _make_key(key: str, from_stage: str, to_stage: str) -> str:
        return f"{key}@{from_stage}->{to_stage}"

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        if self._closed:
            raise KVTransferError("YuanrongConnector is closed")
        key = self._make_key(put_key, from_stage, to_stage)
        frame = data.frame() if isinstance(data, KVCacheTransferData) else codec.encode(data)
        raw = frame.to_bytearray()
        try:
            self.client.set(key, memoryview(raw), self.write_mode, self.ttl_second)
        except RuntimeError as e:
            logger.error("Yuanrong set of %r (%d bytes) failed: %s", key, len(raw), e)
            return False, 0, None
        self._keys.add(key)
        return True, len(raw), {"key": key, "data_size": len(raw)}

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        if self._closed:
            raise KVTransferError("YuanrongConnector is closed")
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            values = self.client.get([key], False, self.get_sub_timeout_ms)
        except RuntimeError as e:
            logger.debug("Yuanrong get of %r: %s", key, e)
            return None
        if not values or values[0] is None:
            return None
        raw = values[0]
        return codec.decode(raw), len(raw)

    def cleanup(self, request_id: str) -> None:
        if self._closed:
            return
        prefix = f"{request_id}@"
        keys = [k for k in self._keys if k == request_id or k.startswith(prefix)]
        if keys:
            try:
                self.client.delete(keys)
            except RuntimeError as e:
                logger.warning("Yuanrong delete of %s failed: %s", keys, e)
            self._keys.difference_update(keys)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keys and self.client is not None:
            try:
                self.client.delete(list(self._keys))
            except RuntimeError as e:
                logger.warning("Yuanrong delete on close failed: %s", e)
        self._keys.clear()
        self.client = None

    def health(self) -> dict[str, Any]:
        if self._closed or self.client is None:
            return {"status": "closed", "backend": "yuanrong"}
        ok = bool(self.client.health_check().is_ok())
        return {
            "status": "healthy" if ok else "unhealthy",
            "backend": "yuanrong",
            "worker": f"{self.host}:{self.port}",
            "pending_keys": len(self._keys),
        }


def selftest() -> dict[str, Any]:
    """Importability of both Yuanrong packages; a KV round trip when
    ``OMNIKV_YUANRONG_WORKER=host:port`` names a running datasystem worker."""
    notes = []
    for label, fn in (
        ("datasystem", import_kv_client),
        ("transfer engine", import_transfer_engine),
    ):
        try:
            fn()
            notes.append(f"{label}: importable")
        except BackendUnavailable as e:
            notes.append(f"{label}: {e}")
    worker = os.environ.get("OMNIKV_YUANRONG_WORKER")
    if not worker:
        return {
            "ok": False,
            "detail": "; ".join(notes) + "; no worker (set OMNIKV_YUANRONG_WORKER)",
        }
    try:
        host, port = worker.rsplit(":", 1)
        with YuanrongConnector({"host": host, "port": int(port)}) as conn:
            ok, size, _ = conn.put("0", "1", "omnikv-selftest", {"s": "hi", "b": b"x" * 4096})
            got = conn.get("0", "1", "omnikv-selftest")
            conn.cleanup("omnikv-selftest")
        good = ok and got is not None and got[0]["s"] == "hi" and got[0]["b"] == b"x" * 4096
        return {"ok": bool(good), "detail": f"worker {worker}: {size} B round trip"}
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}
