"""``OmniKVTransferManager``: the vllm-omni API (names unchanged) over a
:class:`~vllm_omni_kv.transfer.session.TransferSession`, for vLLM and vLLM-free
stages alike. Keys, retries, parts, polling and ranged loads are the session's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.errors import (
    BackendUnavailable,
    ConfigError,
    KVPayloadError,
    KVTransferTimeout,
    OmniKVError,
)
from vllm_omni_kv.kvcache.formats import plan_injection
from vllm_omni_kv.kvcache.kv_utils import (
    KVTPTopology,
    LayerKV,
    get_local_tp_rank,
    merge_received_rank_shards,
    slice_received_rank_shard,
    validate_kv_tp_topology,
)
from vllm_omni_kv.kvcache.paged_blocks import blocks_to_tokens, is_block_payload
from vllm_omni_kv.kvcache.shared_pages import is_shared_payload
from vllm_omni_kv.kvcache.shared_pages_plan import materialize_pages
from vllm_omni_kv.kvcache.token_major import extract_request_kv, to_device, trim_to_num_tokens
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer import distributed
from vllm_omni_kv.transfer.kv_config import (
    OmniKVCacheConfig,
    config_from_stage,
    config_from_vllm,
    connector_spec,
)
from vllm_omni_kv.transfer.parts import part_layer_count
from vllm_omni_kv.transfer.request_kv import attach_extras, attach_kv, cfg_request_ids
from vllm_omni_kv.transfer.session import SessionPolicy, TransferSession, sender_endpoint
from vllm_omni_kv.wire.auth import key_from_config
from vllm_omni_kv.wire.payload import KVCacheTransferData

logger = init_logger(__name__)


class OmniKVTransferManager:
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
        #: the shared secret (read once, here); None without one
        self.auth = key_from_config(config.auth_key_file)
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
        return cls(config_from_stage(config))

    from_model_config = from_od_config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any) -> OmniKVTransferManager:
        """Create from ``model_config.omni_kv_config``, else from ``kv_transfer_config``'s
        ``kv_connector_extra_config`` (``omni_connector_config`` plus the stage keys)."""
        return cls(config_from_vllm(vllm_config, model_config))

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
            spec = connector_spec(self.config, self.auth)
            try:
                self._connector = OmniConnectorFactory.create_connector(spec)
            except Exception as e:
                self.connector_error = e
                logger.error("KV connector %s failed to start: %s", spec.name, e)
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

    def _session(self, *, sending: bool) -> TransferSession:
        stages = self.send_stages if sending else self.recv_stages
        if stages[0] is None or stages[1] is None:
            if sending:
                raise ConfigError("sending needs omni_from_stage and omni_to_stage in the config")
            raise ConfigError(
                "receiving needs need_recv_cache, a source stage (engine_input_source or "
                "omni_from_stage) and stage_id"
            )
        c = self.config
        policy = SessionPolicy(
            c.poll_interval, c.max_poll_interval, c.send_retries, c.retry_backoff, c.max_part_bytes
        )
        return TransferSession(
            self.connector,
            stages[0],
            stages[1],
            policy,
            send_key_hook=self.kv_send_key_builder,
            recv_key_hook=self.kv_recv_key_builder,
            auth=self.auth,
        )

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
            "cache_dtype": str(cache_dtype),
            "from_stage": self.send_stages[0],
            "from_rank": self.local_rank,
            "from_tp": self.config.from_tp,
            "to_tp": self.config.to_tp,
        }
        data = extract_request_kv(
            request_id, block_ids, seq_len, kv_caches, metadata=meta, lazy=lazy
        )
        if data.metadata["block_size"] != int(block_size):
            raise ConfigError(
                f"block_size {block_size} does not match the caches' block size "
                f"{data.metadata['block_size']}"
            )
        return data

    def send_kv_cache(self, request_id: str, data: KVCacheTransferData | Any) -> bool:
        """Send ``data`` to every target rank's key (retries and parts: the session's).

        True when every key was sent; failures are logged. Payloads above
        ``max_part_bytes`` go out as layer-wise parts (by default only over
        backends that cannot stream).
        """
        session = self._session(sending=True)
        for key in session.send_keys(request_id, self.topology(sending=True)):
            try:
                size = session.send(key, data)
            except KVPayloadError:
                raise
            except OmniKVError as e:
                logger.error("%s", e)
                return False
            logger.debug("sent KV %s (%d bytes)", key, size)
        return True

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

    # -- sender endpoints -------------------------------------------------------------------
    def update_sender_info(
        self, sender_info: dict[Any, Any], sender_stage_id: str | int | None = None
    ) -> None:
        """Record the sender's host and rank-0 ZMQ port (other ranks: the session's rule)."""
        info = sender_info
        for k in (sender_stage_id, str(sender_stage_id)):
            if sender_stage_id is not None and isinstance(sender_info.get(k), dict):
                info = sender_info[k]
                break
        host = info.get("host") or info.get("sender_host")
        port = info.get("zmq_port") or info.get("sender_zmq_port") or info.get("port")
        if not host or port is None:
            raise ConfigError(f"sender_info needs 'host' and 'zmq_port', got keys {sorted(info)}")
        self._sender_base = (str(host), int(port))
        if self._connector is not None:
            self._push_sender_info()

    def _push_sender_info(self) -> None:
        conn, base = self._connector, self._sender_base
        if conn is None or base is None or not hasattr(conn, "update_sender_info"):
            return
        topo = self.topology(sending=False)
        rank = self.local_rank if not topo.is_heterogeneous else 0
        md = sender_endpoint(base[0], base[1], rank)
        assert md is not None
        conn.update_sender_info(md["source_host"], md["source_port"])

    def _endpoint(self, from_rank: int | None) -> dict[str, Any] | None:
        if from_rank is None or self._sender_base is None:
            return None
        return sender_endpoint(*self._sender_base, from_rank)

    # -- receive side -----------------------------------------------------------------------
    def receive_kv_cache_for_request(
        self, request_id: str, target_device: torch.device | None = None
    ) -> tuple[dict[str, Any] | None, int]:
        """Receive (and merge/slice for heterogeneous TP) one request's KV; ``(None, 0)`` on timeout.

        Corrupt payloads raise ``KVPayloadError``: waiting longer cannot fix them.
        """
        session = self._session(sending=False)
        topo = self.topology(sending=False)
        deadline = time.monotonic() + float(self.config.recv_timeout)
        payloads: list[dict[str, Any]] = []
        total = 0
        for key, from_rank in session.recv_keys(request_id, topo):
            try:
                obj, moved = session.fetch(key, self._endpoint(from_rank), deadline)
            except KVTransferTimeout as e:
                logger.warning("no KV for request %s (key %s): %s", request_id, key, e)
                return None, 0
            if is_shared_payload(obj):  # pages of the producer's cache: copy them out
                obj = materialize_pages(obj, session.cache_region)
            payloads.append(blocks_to_tokens(obj) if is_block_payload(obj) else obj)
            total += moved
        data: dict[str, Any] | None
        if len(payloads) > 1:
            data = merge_received_rank_shards(payloads, merger=self.kv_payload_merger)
        else:
            data = payloads[0]
        if topo.target_tp_size > topo.source_tp_size:
            data = slice_received_rank_shard(data, topo, slicer=self.kv_payload_slicer)
        if data is not None:
            data = trim_to_num_tokens(data)
        if data is not None and target_device is not None:
            data = to_device(data, target_device)
        return data, total

    def receive_kv_cache_into(
        self,
        request_id: str,
        kv_caches: list[LayerKV | None],
        block_ids: list[int],
        *,
        layout: str | None = None,
        start_token: int = 0,
    ) -> tuple[int, int] | None:
        """Receive one request's KV straight into a local paged cache.

        Tokens ``[start_token, num_tokens)`` are written into ``block_ids`` (the first
        ``start_token`` are held locally and do not cross the transport), each part
        as it arrives; over shared memory, block by block while the sender is still
        packing. Returns ``(tokens, bytes moved)``, or None on timeout; then, and
        after any exception, the blocks may hold a partial payload: do not use them.
        Needs equal source and target TP sizes; use :meth:`receive_kv_cache_for_request`
        to merge/slice shards.
        """
        session = self._session(sending=False)
        topo = self.topology(sending=False)
        keys = session.recv_keys(request_id, topo)
        if len(keys) != 1 or topo.is_heterogeneous:
            raise ConfigError(
                "receive_kv_cache_into needs equal source and target TP sizes; "
                "use receive_kv_cache_for_request for heterogeneous TP"
            )
        key, from_rank = keys[0]

        def plan(part: dict[str, Any], layer_start: int) -> Any:
            local = kv_caches[layer_start : layer_start + part_layer_count(part)]
            return plan_injection(part, local, block_ids, start_token=start_token, layout=layout)

        deadline = time.monotonic() + float(self.config.recv_timeout)
        try:
            return session.receive_into(key, self._endpoint(from_rank), deadline, plan)
        except KVTransferTimeout as e:
            logger.warning("incomplete KV for request %s: %s", request_id, e)
            return None

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
        """Set ``req.past_key_values`` (``key_cache``/``value_cache`` lists of ``[seq, heads,
        dim]`` tensors) and ``req.kv_metadata``, mirrored onto ``req.sampling_params``."""
        attach_kv(req, data)

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Receive the primary KV, then CFG companions through ``cfg_kv_collect_func``."""
        ok, extras = self.receive_primary_and_companions(req, cfg_kv_collect_func, target_device)
        if ok and extras:
            attach_extras(req, extras)
        return ok

    def receive_primary_and_companions(
        self, req: Any, func: Callable | None, target_device: torch.device | None
    ) -> tuple[bool, dict[str, Any]]:
        """The primary KV attached to ``req``, and what ``func`` collects for its CFG companions."""
        if not self.receive_kv_cache(req, target_device):
            return False, {}
        cfg_ids = cfg_request_ids(req)
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
