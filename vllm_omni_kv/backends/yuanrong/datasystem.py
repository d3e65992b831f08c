"""``YuanrongConnector``: packed frames stored in an openYuanrong datasystem worker.

Through ``yr.datasystem.KVClient`` (``set`` / ``get`` with ``sub_timeout_ms`` /
``delete`` / ``health_check``); package ``openyuanrong-datasystem``. Config:
``host`` / ``port`` of the worker (default 127.0.0.1:31501), ``connect_timeout_ms``
(60000), ``get_sub_timeout_ms`` (1000: how long ``get`` waits for a key),
``ttl_second`` (0: until deleted), ``write_mode`` (a ``WriteMode`` name, default
``NONE_L2_CACHE``).

Verified on a CPU-only host: ``KVClient`` imports and its ``init()`` fails cleanly
(RuntimeError, within ``connect_timeout_ms``) when no worker listens; a
``datasystem_worker`` (which needs an etcd/metastore cluster) was not started, so
``set``/``get`` were not exercised against a live worker.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.keys import edge_key, is_request_key
from vllm_omni_kv.backends.pull.yuanrong import import_transfer_engine
from vllm_omni_kv.backends.stats import COMMON, Counters
from vllm_omni_kv.errors import BackendUnavailable, ConfigError, KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import ArrivedFrameStream, PayloadStream

logger = init_logger(__name__)

DATASYSTEM_PACKAGE = "openyuanrong-datasystem"


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


class YuanrongConnector(OmniConnectorBase):
    """Datasystem-based distributed connector (frames stored in a Yuanrong worker)."""

    TRANSPORT: ClassVar[str] = "yuanrong"
    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset(
        "host port get_sub_timeout_ms ttl_second connect_timeout_ms write_mode".split()
    )

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
        self._stats = Counters(*COMMON)
        self._closed = False

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        if self._closed:
            raise KVTransferError("YuanrongConnector is closed")
        key = edge_key(put_key, from_stage, to_stage)
        frame = data.frame() if isinstance(data, KVCacheTransferData) else codec.encode(data)
        raw = frame.to_bytearray()
        try:
            self.client.set(key, memoryview(raw), self.write_mode, self.ttl_second)
        except RuntimeError as e:
            logger.error("Yuanrong set of %r (%d bytes) failed: %s", key, len(raw), e)
            return False, 0, None
        self._keys.add(key)
        self._stats.add("puts")
        self._stats.add("bytes_put", len(raw))
        return True, len(raw), {"key": key, "data_size": len(raw)}

    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Fetch the whole frame (``moved`` is its size); chunks are verified as ``load``
        reaches them. None when the key does not appear within ``get_sub_timeout_ms``."""
        if self._closed:
            raise KVTransferError("YuanrongConnector is closed")
        key = edge_key(get_key, from_stage, to_stage)
        try:
            values = self.client.get([key], False, self.get_sub_timeout_ms)
        except RuntimeError as e:
            logger.debug("Yuanrong get of %r: %s", key, e)
            values = None
        if not values or values[0] is None:
            self._stats.add("misses")
            return None
        stream = ArrivedFrameStream(values[0])
        self._stats.add("gets")
        self._stats.add("bytes_got", stream.size)
        return stream

    def discard(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None = None
    ) -> bool:
        """Delete ``key`` without reading it; True when the worker held it (or, for a
        client without ``exist``, when the delete succeeded)."""
        if self._closed:
            raise KVTransferError("YuanrongConnector is closed")
        bkey = edge_key(key, from_stage, to_stage)
        try:
            exist = getattr(self.client, "exist", None)
            if exist is not None and not any(exist([bkey])):
                return False
            self.client.delete([bkey])
        except RuntimeError as e:
            logger.warning("Yuanrong discard of %r failed: %s", bkey, e)
            return False
        self._keys.discard(bkey)
        return True

    def cleanup(self, request_id: str) -> None:
        if self._closed:
            return
        keys = [k for k in self._keys if is_request_key(k, request_id)]
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
            **self._stats.snapshot(),
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
