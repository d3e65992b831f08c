"""``OmniKVTransferManager``: connector lifecycle, KV extraction, send with retry,
receive with timeout, for vLLM and vLLM-free stages alike."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.errors import BackendUnavailable, ConfigError, KVPayloadError, OmniKVError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer import distributed
from vllm_omni_kv.transfer.config import ConnectorSpec
from vllm_omni_kv.transfer.extract import extract_request_kv
from vllm_omni_kv.transfer.kv_config import (
    DEFAULT_MAX_PART_BYTES,
    OmniKVCacheConfig,
    config_from_omni_kv,
    field_of,
)
from vllm_omni_kv.transfer.kv_utils import (
    KVTPTopology,
    LayerKV,
    build_rank_aware_send_keys,
    get_local_tp_rank,
    validate_kv_tp_topology,
)
from vllm_omni_kv.transfer.parts import send_parts
from vllm_omni_kv.transfer.payload import KVCacheTransferData
from vllm_omni_kv.transfer.receiver import KVReceiver

logger = init_logger(__name__)


class OmniKVTransferManager(KVReceiver):
    """Unified management of an omni connector and the KV transfers through it."""

    def __init__(self, config: OmniKVCacheConfig) -> None:
        self.config = config
        self.kv_send_key_builder: Callable | None = None
        self.kv_recv_key_builder: Callable | None = None
        self.kv_payload_merger: Callable | None = None
        self.kv_payload_slicer: Callable | None = None
        self._connector: OmniConnectorBase | None = None
        self.connector_error: BaseException | None = None
        self._lock = threading.Lock()
        self._sender_base: tuple[str, int] | None = None
        recv_from = (
            config.engine_input_source[0] if config.engine_input_source else config.from_stage
        )
        if config.need_recv_cache and recv_from is not None and config.stage_id is not None:
            self.recv_stages: tuple[str | None, str | None] = (str(recv_from), str(config.stage_id))
        elif recv_from is not None and config.to_stage is not None and config.need_recv_cache:
            self.recv_stages = (str(recv_from), str(config.to_stage))
        else:
            self.recv_stages = (None, None)
        if config.from_stage and config.to_stage:
            self.send_stages: tuple[str | None, str | None] = (config.from_stage, config.to_stage)
        else:
            self.send_stages = (None, None)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_od_config(cls, config: Any) -> OmniKVTransferManager:
        """Create from a stage config carrying ``omni_kv_config`` (model or OmniDiffusion config)."""
        kv = field_of(config, "omni_kv_config")
        if kv is None:
            return cls(OmniKVCacheConfig())
        return cls(config_from_omni_kv(kv, stage_id=field_of(config, "stage_id")))

    from_model_config = from_od_config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any) -> OmniKVTransferManager:
        """Create from ``model_config.omni_kv_config``, else from ``kv_transfer_config``'s
        ``kv_connector_extra_config`` (``omni_connector_config`` plus the stage keys)."""
        if model_config is not None and field_of(model_config, "omni_kv_config") is not None:
            return cls.from_od_config(model_config)
        ktc = field_of(vllm_config, "kv_transfer_config")
        extra = dict(field_of(ktc, "kv_connector_extra_config") or {}) if ktc is not None else {}
        if "omni_connector_config" not in extra:
            return cls(OmniKVCacheConfig())
        kv = {**extra, "connector_config": extra["omni_connector_config"]}
        role = field_of(ktc, "kv_role")
        kv.setdefault("need_send_cache", role in ("kv_producer", "kv_both"))
        kv.setdefault("need_recv_cache", role in ("kv_consumer", "kv_both"))
        return cls(config_from_omni_kv(kv))

    # -- connector lifecycle ---------------------------------------------------------------
    @property
    def connector(self) -> OmniConnectorBase:
        """The connector, created on first use. A failed start is logged once and re-raised."""
        if self._connector is not None:
            return self._connector
        with self._lock:
            if self._connector is not None:
                return self._connector
            if self.connector_error is not None:
                raise BackendUnavailable(
                    f"the KV connector failed to start earlier: {self.connector_error}"
                ) from self.connector_error
            cc = self.config.connector_config
            if not cc:
                raise ConfigError(
                    "no connector configured: set connector_config={'type': 'SharedMemoryConnector', ...}"
                )
            cc = dict(cc)
            name = cc.pop("type", None) or cc.pop("name", None)
            if not name:
                raise ConfigError("connector_config.type is missing (e.g. 'SharedMemoryConnector')")
            try:
                self._connector = OmniConnectorFactory.create_connector(
                    ConnectorSpec(str(name), cc)
                )
            except Exception as e:
                self.connector_error = e
                logger.error("KV connector %s failed to start: %s", name, e)
                raise
            if self._sender_base is not None:
                self._push_sender_info()
            return self._connector

    get_connector = property(lambda self: self.connector)

    def close(self) -> None:
        """Close the connector if it was created; idempotent."""
        with self._lock:
            conn, self._connector = self._connector, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> OmniKVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- topology ---------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self.config.local_rank if self.config.local_rank is not None else get_local_tp_rank()

    def topology(self, *, sending: bool) -> KVTPTopology:
        topo = KVTPTopology(
            source_tp_size=self.config.from_tp,
            target_tp_size=self.config.to_tp,
            local_rank=self.local_rank,
        )
        validate_kv_tp_topology(topo)
        return topo

    # -- send side --------------------------------------------------------------------------
    def extract_kv_cache(
        self,
        request_id: str,
        block_ids: list[int],
        seq_len: int,
        kv_caches: list[LayerKV],
        block_size: int,
        cache_dtype: str,
        *,
        lazy: bool = False,
    ) -> KVCacheTransferData:
        """Extract one request's KV from paged blocks as ``[seq_len, heads, dim]`` per layer."""
        meta = {
            "block_size": int(block_size),
            "cache_dtype": str(cache_dtype),
            "from_stage": self.send_stages[0],
            "from_rank": self.local_rank,
            "from_tp": self.config.from_tp,
            "to_tp": self.config.to_tp,
        }
        return extract_request_kv(
            request_id, block_ids, seq_len, kv_caches, metadata=meta, lazy=lazy
        )

    def send_kv_cache(self, request_id: str, data: KVCacheTransferData | Any) -> bool:
        """Send ``data`` to every target rank's key, retrying with backoff; True when all succeeded.

        Payloads above ``max_part_bytes`` go out as layer-wise parts (see
        :mod:`vllm_omni_kv.transfer.parts`; by default only over backends that
        cannot stream).
        """
        from_stage, to_stage = self.send_stages
        if from_stage is None or to_stage is None:
            raise ConfigError("sending needs omni_from_stage and omni_to_stage in the config")
        keys = build_rank_aware_send_keys(
            request_id, from_stage, to_stage, self.topology(sending=True), self.kv_send_key_builder
        )
        conn = self.connector

        def put(key: str, part: Any) -> bool:
            return self._put_with_retry(conn, from_stage, to_stage, key, part)

        limit = self.config.max_part_bytes
        if limit is None:
            limit = 0 if conn.supports_streaming else DEFAULT_MAX_PART_BYTES
        return all(send_parts(put, k, data, limit) for k in keys)

    def _put_with_retry(
        self, conn: OmniConnectorBase, from_stage: str, to_stage: str, key: str, data: Any
    ) -> bool:
        delay = self.config.retry_backoff
        for attempt in range(1, self.config.send_retries + 1):
            try:
                ok, size, _meta = conn.put(from_stage, to_stage, key, data)
                if ok:
                    logger.debug("sent KV %s (%d bytes, attempt %d)", key, size, attempt)
                    return True
                reason = "connector returned failure"
            except KVPayloadError:
                raise  # the payload itself is bad: retrying cannot help
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
            if attempt < self.config.send_retries:
                logger.warning(
                    "sending KV %s failed (%s); retry %d in %.2fs", key, reason, attempt, delay
                )
                time.sleep(delay * (1 + random.random() * 0.1))
                delay *= 2
            else:
                logger.error("sending KV %s failed after %d attempts: %s", key, attempt, reason)
        return False

    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: dict[str, dict[str, Any]],
        kv_caches: list[LayerKV],
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Extract and send KV for finished requests; return the ids that were really sent.

        ``finished_reqs`` maps request id to ``{"block_ids": [...], "seq_len": n}``.
        """
        if not self.config.need_send_cache or not finished_reqs:
            return []
        sent: list[str] = []
        for req_id, info in finished_reqs.items():
            try:
                block_ids = list(info["block_ids"])
                seq_len = int(info.get("seq_len") or len(block_ids) * block_size)
                tx_id = request_id_resolver(req_id) if request_id_resolver else req_id
                data = self.extract_kv_cache(
                    tx_id, block_ids, seq_len, kv_caches, block_size, cache_dtype, lazy=True
                )
                if self.send_kv_cache(tx_id, data):
                    sent.append(req_id)
            except OmniKVError as e:
                logger.error("KV transfer of request %s failed: %s", req_id, e)
            except (KeyError, TypeError, ValueError) as e:
                logger.error("KV transfer of request %s skipped: bad request info (%s)", req_id, e)
        return sent

    # -- receive side -----------------------------------------------------------------------
    def receive_kv_cache(self, req: Any, target_device: torch.device | None = None) -> bool:
        """Receive KV for ``req.request_id`` and attach it to ``req`` (legacy interface)."""
        try:
            data, _size = self.receive_kv_cache_for_request(str(req.request_id), target_device)
        except OmniKVError as e:
            logger.error(
                "receiving KV for request %s failed: %s", getattr(req, "request_id", "?"), e
            )
            return False
        if data is None:
            return False
        self.apply_kv_cache_to_request(req, data)
        return True

    def apply_kv_cache_to_request(self, req: Any, data: dict[str, Any]) -> None:
        """Attach received KV to ``req``.

        Sets ``req.past_key_values`` (with ``key_cache``/``value_cache`` lists of
        ``[seq, heads, dim]`` tensors) and ``req.kv_metadata``; mirrors both onto
        ``req.sampling_params`` when the request has one.
        """
        blocks = data.get("layer_blocks", {})
        pkv = SimpleNamespace(
            key_cache=blocks.get("key_cache", []),
            value_cache=blocks.get("value_cache", []),
            request_id=data.get("request_id"),
            block_ids=data.get("block_ids", []),
        )
        meta = data.get("metadata", {})
        for target in (req, getattr(req, "sampling_params", None)):
            if target is None:
                continue
            target.past_key_values = pkv
            target.kv_metadata = meta

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Receive the primary KV, then CFG companions through ``cfg_kv_collect_func``."""
        ok, extras = self._receive_primary_and_companions(req, cfg_kv_collect_func, target_device)
        if ok and extras:
            _attach_extras(req, extras)
        return ok

    def _receive_primary_and_companions(
        self, req: Any, func: Callable | None, target_device: torch.device | None
    ) -> tuple[bool, dict[str, Any]]:
        if not self.receive_kv_cache(req, target_device):
            return False, {}
        cfg_ids = _cfg_request_ids(req)
        if not cfg_ids or func is None:
            return True, {}
        try:
            extras = func(str(req.request_id), cfg_ids, self, target_device) or {}
        except OmniKVError as e:
            logger.error("collecting CFG companion KV for %s failed: %s", req.request_id, e)
            extras = {}
        return True, dict(extras)

    def receive_multi_kv_cache_distributed(
        self,
        req: Any,
        cfg_kv_collect_func: Callable | None = None,
        target_device: torch.device | None = None,
        *,
        tp_size: int | None = None,
    ) -> bool:
        """TP-aware wrapper of :meth:`receive_multi_kv_cache` (see :mod:`.distributed`)."""
        return distributed.receive_multi_distributed(
            self, req, cfg_kv_collect_func, target_device, tp_size=tp_size
        )


def _cfg_request_ids(req: Any) -> list[str] | None:
    for src in (req, getattr(req, "sampling_params", None)):
        ids = getattr(src, "cfg_kv_request_ids", None) if src is not None else None
        if ids:
            return [str(i) for i in ids]
    return None


def _attach_extras(req: Any, extras: dict[str, Any]) -> None:
    target = getattr(req, "sampling_params", None) or req
    for k, v in extras.items():
        setattr(target, k, v)
