"""``OmniKVConnector``: vLLM's ``KVConnectorBase_V1`` over vllm-omni-kv backends.

A thin shell: the scheduler process gets an :class:`OmniKVScheduler`, each
worker an :class:`OmniKVWorker`, and every vLLM hook delegates to its half.

Enable it with::

    --kv-transfer-config '{"kv_connector": "OmniKVConnector", "kv_role": "kv_producer",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"backend": "shm"}}'

(also loadable with ``"kv_connector_module_path":
"vllm_omni_kv.connector.omni_kv_connector"``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_omni_kv.connector.config import OmniKVConfig, parse_omni_kv_config
from vllm_omni_kv.connector.handshake import advertise, worker_handshake
from vllm_omni_kv.connector.metadata import OmniKVConnectorMetadata
from vllm_omni_kv.connector.scheduler import OmniKVScheduler
from vllm_omni_kv.connector.sleep import WorkerSleep, supports_sleep
from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.connector.worker import OmniKVWorker
from vllm_omni_kv.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class OmniKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer through shared memory, Mooncake TE or any omni backend.

    Supports vLLM's hybrid KV cache manager (``SupportsHMA``): with several KV cache
    groups (sliding window + full attention) every group's blocks are moved, each
    sliding-window group only the blocks still inside its window
    (:mod:`vllm_omni_kv.connector.kv_groups`).
    """

    # Every external hit is KV handed over by a peer stage: vLLM's
    # vllm:prompt_tokens_cached_by_source counts them under source="p2p".
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self.omni_config: OmniKVConfig = parse_omni_kv_config(
            ktc.kv_connector_extra_config, ktc.kv_role
        )
        engine_id = str(ktc.engine_id)
        self._sched: OmniKVScheduler | None = None
        self._worker: OmniKVWorker | None = None
        self._sleep: WorkerSleep | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = OmniKVScheduler(
                vllm_config, self.omni_config, engine_id, kv_cache_config=kv_cache_config
            )
        else:
            self._worker = OmniKVWorker(
                vllm_config, self.omni_config, engine_id, kv_cache_config=kv_cache_config
            )
            self._sleep = WorkerSleep(self._worker)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout named in ``kv_connector_extra_config.kv_cache_layout``; by default
        none: the connector reads whatever layout the attention backend resolves and
        converts between producer and consumer layouts when they differ."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        return parse_omni_kv_config(extra).kv_cache_layout

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's check for ``--enable-sleep-mode``: whether this config's backend
        withdraws and restores its exports around sleep (:func:`.sleep.supports_sleep`)."""
        return supports_sleep(
            kv_transfer_config.kv_connector_extra_config, kv_transfer_config.kv_role
        )

    # -- helpers ---------------------------------------------------------------------------
    @property
    def scheduler_half(self) -> OmniKVScheduler:
        if self._sched is None:
            raise RuntimeError("OmniKVConnector: scheduler-side method called on a worker")
        return self._sched

    @property
    def worker_half(self) -> OmniKVWorker:
        if self._worker is None:
            raise RuntimeError("OmniKVConnector: worker-side method called in the scheduler")
        return self._worker

    def _meta(self) -> OmniKVConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, OmniKVConnectorMetadata) else None

    # -- worker side -----------------------------------------------------------------------
    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        # vLLM allocates the KV cache inside it: the backend's exportable region, if any
        return None if self._worker is None else self._worker.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_half.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33's sleep / discard: nothing may read or write the cache after this
        if self._sleep is not None:
            self._sleep.sleep()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33's wake-up: the cache is exported (registered) again, a new generation
        if self._sleep is not None:
            self._sleep.wake()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # both runners call this before the forward that may reuse preempted blocks
        meta = kv_connector_metadata
        if isinstance(meta, OmniKVConnectorMetadata):
            self.worker_half.handle_preemptions(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Whether this step runs a forward pass comes from the scheduler's metadata:
        # vLLM's V2 model runner calls this after the forward, under a forward context
        # without attention metadata, on every step.
        meta = self._meta()
        self.worker_half.start_load_kv(meta, idle_step=meta is not None and meta.idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (between steps): nothing is pending for a forward pass.
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # The whole request is sent once its prefill completes (wait_for_save).
        return None

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker_half.get_transfer_results(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # failed_recving stays empty: a failed load reports its blocks in
        # get_block_ids_with_load_errors, so vLLM keeps the prompt's valid prefix (one
        # KV cache group) instead of recomputing the whole request.
        # With several KV cache groups vLLM cannot map block ids back to requests: a failed
        # load is reported in failed_recving instead (the request recomputes or fails).
        sending, recving = self.worker_half.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self.worker_half.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.take_invalid_block_ids()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return worker_handshake(self.worker_half.session.endpoint())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_half.take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from vllm_omni_kv.connector.prom import OmniKVPromMetrics

        return OmniKVPromMetrics(
            vllm_config,
            metric_types,  # type: ignore[arg-type]
            labelnames,
            per_engine_labelvalues,
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return OmniKVConnectorStats(data=dict(data or {}))

    # -- scheduler side --------------------------------------------------------------------
    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        # the side-channel endpoint the workers bound, advertised in kv_transfer_params
        self.scheduler_half.cfg = advertise(self.scheduler_half.cfg, dict(metadata))

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_half.kv_cache_manager = kv_cache_manager

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A P/D transfer restores the request's own blocks in every transfer group (a
        # sliding-window group: the blocks inside its window, all vLLM keeps there).
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_half.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # one request computes locally; vLLM's scheduler keeps running
            logger.exception("request %s: remote KV lookup failed", request.request_id)
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, block_ids)
