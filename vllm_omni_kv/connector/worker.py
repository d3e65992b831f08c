"""Worker half of :class:`OmniKVConnector`: moves KV between paged blocks and a transfer session.

Send (producer): in ``wait_for_save`` every request whose prefill completed this
step becomes one payload per target rank, in the paged-blocks format (the
layers' blocks as the cache holds them) or token-major (heterogeneous TP or
``transfer_format``), gathered lazily straight into the backend's buffer (one
copy). Each frame is verified per paged block, so a consumer can check exactly
the blocks it reads. With a backend that exports the cache, the payload names the
blocks instead (:mod:`.page_export`). Every payload is a handoff with a lease
(:mod:`.handoff`), which also decides when a request is reported in
``finished_sending``. Only a producer (``kv_producer``/``kv_both``) runs this side.

Receive (consumer): ``start_load_kv`` hands each load to a background thread.
The session polls the backend until the payload is there (bounded by
``recv_timeout`` from when the load was scheduled), the payload is checked
against the request (prompt digest, token count, block size, shapes) and only
the tokens the consumer lacks cross the transport and are written into its
blocks. A load whose request vLLM finished (aborted) is cancelled. Every load
ends in ``finished_recving``; a failed one also reports its blocks from
``get_block_ids_with_load_errors`` so vLLM recomputes (or fails) the request.
"""

from __future__ import annotations

import functools
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.connector.affinity import background_cpus, describe, spawn_on
from vllm_omni_kv.connector.compat import COMPAT_KEY, engine_compat
from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.engine_layout import EngineLayout, engine_layout
from vllm_omni_kv.connector.handoff import ProducerHandoffs
from vllm_omni_kv.connector.inflight import InflightLoads
from vllm_omni_kv.connector.kv_groups import LayerGroups, group_layers
from vllm_omni_kv.connector.loads import LoadRunner
from vllm_omni_kv.connector.metadata import (
    OmniKVConnectorMetadata,
    OmniKVWorkerMetadata,
    SaveSpec,
)
from vllm_omni_kv.connector.notices import Notices
from vllm_omni_kv.connector.outcome import Outcome as _Outcome
from vllm_omni_kv.connector.outcome import report
from vllm_omni_kv.connector.page_export import PageExport, export_pages
from vllm_omni_kv.connector.receive import LayerCache, forward_mark, layer_caches, token_caches
from vllm_omni_kv.connector.state_layers import (
    StateLayer,
    check_states_format,
    extract_payload,
    split_states,
)
from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.errors import (
    ConfigError,
    OmniKVError,
)
from vllm_omni_kv.kvcache.device_staging import DeviceStager
from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, get_local_tp_rank, get_tp_world_size
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.session import SessionPolicy, TransferSession
from vllm_omni_kv.wire.payload import KVCacheTransferData

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

#: longest wait for loads to land on an engine step that has nothing else to do
IDLE_WAIT_S = 0.1
#: longest wait for a consumer to release held blocks on a step with nothing to compute
#: (short: a new request arriving meanwhile waits for the next step)
HOLD_WAIT_S = 0.02
#: backends of one host's shared memory (their frames can stream while written)
SHM_BACKENDS = frozenset({"SharedMemoryConnector", "CudaIpcConnector"})
#: how often the payloads-held gauge asks the backend
HELD_EVERY_S = 1.0
#: how long past ``recv_timeout`` shutdown waits for cancelled loads before it closes the
#: backend under them (a load past its deadline waits on a paused producer's transfers)
SHUTDOWN_GRACE_S = 30.0
#: how long it waits for them once the backend is closed
SHUTDOWN_WAIT_S = 5.0


class OmniKVWorker:
    """State of one worker process (one TP rank)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: OmniKVConfig,
        engine_id: str,
        kv_cache_config: Any = None,
        engine: EngineLayout | None = None,
    ) -> None:
        """``engine``: the cache's layout facts; default read from ``vllm_config`` and
        ``kv_cache_config`` when the caches are registered."""
        self.cfg = cfg
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine = engine
        self.groups = LayerGroups.of(kv_cache_config)  # hybrid KV cache manager groups
        self.block_size = int(vllm_config.cache_config.block_size)
        self.compat = engine_compat(vllm_config)
        self.tp_rank = get_local_tp_rank()
        self.tp_size = get_tp_world_size()
        self.target_tp_size = cfg.target_tp_size or self.tp_size
        ktc = getattr(vllm_config, "kv_transfer_config", None)  # None: both roles
        self.is_producer = ktc is None or bool(ktc.is_kv_producer)
        self.is_consumer = ktc is None or bool(ktc.is_kv_consumer)
        self.session = self._open_session(cfg)
        cfg.log_trust()
        self.layers: list[LayerCache] = []
        self.states: list[StateLayer] = []  # Mamba / GDN / short-conv layers (hybrid models)
        self.paged_blocks = False
        self.stats = OmniKVConnectorStats()
        self._idle_step = False
        self._loads: LoadRunner | None = None  # consumer: set once the caches are registered
        self.inflight = InflightLoads(cfg.load_threads)
        self._notices = Notices()
        self._invalid_blocks, self._failed_recving = set[int](), set[str]()  # failed loads
        self._worker_meta: dict[str, dict[str, Any]] = {}
        # producer: every payload published, its lease and hold, until vLLM may free it
        self._handoffs = (
            ProducerHandoffs(self.session, cfg.send_ttl, grace=cfg.hold_grace)
            if self.is_producer
            else None
        )
        self._expired_seen = self._dropped_seen = 0
        self._closed = False
        self._held_checked = 0.0
        self._stager: DeviceStager | None = None  # CUDA caches: one staging buffer per device
        self._region = self.session.cache_region  # one-copy pages (export or copy)
        self._export: PageExport | None = None  # producer: set once the cache is in the region

    def _open_session(self, cfg: OmniKVConfig) -> TransferSession:
        spec = cfg.backend
        if "local_rank" not in spec.extra:  # per-rank side-channel ports (network backends)
            spec = ConnectorSpec(spec.name, {**spec.extra, "local_rank": self.tp_rank})
        if cfg.backend_name in SHM_BACKENDS and "stream" not in spec.extra:
            # a consumer learns a key only once its payload is complete: a frame streamed
            # while it is written overlaps nothing here (the manager API keeps streaming)
            spec = ConnectorSpec(spec.name, {**spec.extra, "stream": False})
        cpus = background_cpus(cfg.transfer_cpus)
        if cpus is not None:
            logger.info("OmniKVConnector: transfer threads run on CPUs %s", describe(cpus))
        policy = SessionPolicy(
            cfg.poll_interval, cfg.max_poll_interval, max_part_bytes=cfg.max_part_bytes
        )
        try:
            with spawn_on(cpus):  # the backend's threads (side channel, engine I/O)
                return TransferSession.open(
                    spec, cfg.from_stage, cfg.to_stage, policy, auth=cfg.auth
                )
        except OmniKVError as e:
            raise type(e)(f"kv_connector_extra_config.backend {cfg.backend.name!r}: {e}") from e

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """Where vLLM allocates the KV cache: a producer's exportable region, if any (a
        consumer never exports its cache)."""
        if self._region is None or not self.is_producer:
            return None
        return self._region.allocation_context()

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.engine is None:
            self.engine = engine_layout(self.vllm_config, self.kv_cache_config)
        kv_caches, self.states = split_states(kv_caches, self.engine.states, self.groups)
        self.layers = group_layers(layer_caches(kv_caches, self.engine), self.groups)
        fmt = self.cfg.transfer_format
        self.paged_blocks = fmt != "token_major" and self.target_tp_size == self.tp_size
        if fmt == "paged_blocks" and not self.paged_blocks:
            raise ConfigError(
                "kv_connector_extra_config.transfer_format 'paged_blocks' needs equal producer "
                "and consumer TP sizes; use 'auto'"
            )
        check_states_format(self.states, self.paged_blocks)
        self.groups.check_format(self.paged_blocks)
        if not self.paged_blocks and any(x.kv is None for x in self.layers):
            raise ConfigError(
                f"this engine's KV cache ({self.layers[0].ident.describe()}) has no per-token "
                "K/V view, which token-major transfers (different TP sizes, or "
                "transfer_format 'token_major') need: use equal TP sizes and 'auto'"
            )
        dev = self.layers[0].cache.device if self.layers else None
        if dev is not None and dev.type == "cuda" and self.paged_blocks and self.cfg.staging_bytes:
            self._stager = DeviceStager(dev, self.cfg.staging_bytes)
        if self.is_consumer:
            self._loads = LoadRunner(
                self.session,
                self.cfg,
                self.layers,
                (self.tp_rank, self.tp_size),
                self.block_size,
                self.compat,
                self.states,
            )
        if self._region is not None and self.layers and self.is_producer:
            self._export = self._export_pages()
        if self.layers:
            ident = self.layers[0].ident
            logger.info(
                "OmniKVConnector worker (tp %d/%d, backend %s): %d layers of %d blocks, %s; "
                "sends %s",
                self.tp_rank,
                self.tp_size,
                self.cfg.backend_name,
                len(self.layers),
                int(self.layers[0].cache.shape[0]) // ident.ratio,
                ident.describe(),
                "paged blocks" if self.paged_blocks else "token-major K/V",
            )

    def _export_pages(self) -> PageExport | None:
        """The one-copy export of this producer's cache, or None (packed payloads)."""
        assert self._region is not None
        why = (
            None
            if self.paged_blocks
            else "producer and consumer TP sizes differ (token-major payloads)"
        )
        return export_pages(self._region, self.layers, self.cfg.backend_name, why, self.states)

    # -- send ----------------------------------------------------------------------------
    def _payload(self, spec: SaveSpec, hold: str = "") -> tuple[KVCacheTransferData, int]:
        """The request's payload and its verification chunk (one paged block)."""
        md = {
            "prompt_digest": spec.prompt_digest,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "layer_names": [layer.name for layer in self.layers],
            COMPAT_KEY: self.compat.to_dict(),
        }
        ident = self.layers[0].ident
        if hold and self._export is not None:
            return self._export.payload(spec, self.layers, hold, md), ident.page_bytes
        if self.paged_blocks:
            data = extract_payload(
                spec, self.layers, self.states, ident, md, self._stager, self.block_size
            )
            return data, ident.page_bytes
        data = extract_request_kv(
            spec.transfer_id,
            spec.block_ids,
            spec.num_tokens,
            token_caches(self.layers),
            metadata=md,
            stager=self._stager,
        )
        return data, ident.page_bytes // 2

    def _send(self, spec: SaveSpec, handoffs: ProducerHandoffs) -> None:
        """Publish the request's payloads, each a handoff of ``handoffs``."""
        t0 = time.perf_counter()
        hold, total = "", 0
        try:
            topo = KVTPTopology(self.tp_size, self.target_tp_size, self.tp_rank)
            for key in self.session.send_keys(spec.transfer_id, topo):
                hold = self.session.hold(key) if self._export is not None else ""
                data, chunk = self._payload(spec, hold)
                nbytes, parts = self.session.publish(key, data, chunk_bytes=chunk)
                handoffs.published(spec.req_id, key, hold=hold, parts=parts)
                hold, total = "", total + nbytes
        except Exception as e:  # the consumer will time out and recompute
            if hold:  # created for a payload that was never published
                self.session.take_back(hold)
            handoffs.failed(spec.req_id)
            self.stats.record_send(0, 0.0, ok=False)
            logger.error(
                "OmniKVConnector: sending the KV of request %s failed: %s; the consumer will "
                "recompute it after recv_timeout",
                spec.req_id,
                e,
                exc_info=not isinstance(e, OmniKVError),
            )
            return
        dt = time.perf_counter() - t0
        self.stats.record_send(total, dt, ok=True)
        logger.debug(
            "sent %d tokens of %s: %d bytes in %.2f ms",
            spec.num_tokens,
            spec.req_id,
            total,
            dt * 1e3,
        )

    def wait_for_save(self, meta: OmniKVConnectorMetadata | None) -> None:
        if meta is None or not meta.saves:
            return
        if self._handoffs is None:
            raise ConfigError(
                "OmniKVConnector: a kv_consumer was asked to save KV: use kv_role kv_producer "
                "or kv_both on the stage that prefills"
            )
        if self._export is not None:  # one wait for this step's pages, not one per payload
            self._export.ready(self.layers)
        for spec in meta.saves:
            self._send(spec, self._handoffs)

    def handle_preemptions(self, meta: OmniKVConnectorMetadata | None) -> None:
        """Before the forward that may reuse them: void the payloads of preempted requests
        (vLLM freed their blocks)."""
        if meta is not None and meta.preempted and self._handoffs is not None:
            self._handoffs.revoke(meta.preempted)

    # -- receive -------------------------------------------------------------------------
    def start_load_kv(self, meta: OmniKVConnectorMetadata | None, idle_step: bool = False) -> None:
        self._idle_step = idle_step
        if meta is None or self._closed:
            return
        if meta.withdraws and self._handoffs is not None:
            self._handoffs.withdraw(meta.withdraws)
        if meta.loads or meta.discards or meta.extends:
            self._receive(meta, self._runner())

    def _receive(self, meta: OmniKVConnectorMetadata, runner: LoadRunner) -> None:
        """Queue this step's notices to producers (off the load threads: a silent producer
        delays no load) and start its loads."""
        deadline = time.monotonic() + self.cfg.recv_timeout
        for kind, ds, fn in (("discard", meta.discards, runner.discard),
                             ("extend", meta.extends, runner.extend)):  # fmt: skip
            for d in ds:
                where = f"{d.remote_host}:{d.remote_port}"
                self._notices.submit(kind, d.req_id, where, functools.partial(fn, d))
        # the loads' writes run after what is queued on the forward stream now
        after = forward_mark(self.layers) if meta.loads else None
        for spec in meta.loads:
            load = functools.partial(runner.load, spec, deadline, after=after)
            self.inflight.start(spec.req_id, load, functools.partial(runner.failed, spec, dt=0.0))

    def _runner(self) -> LoadRunner:
        if self._loads is None:
            raise ConfigError(
                "OmniKVConnector: a kv_producer was asked to load KV: use kv_role kv_consumer "
                "or kv_both on the stage that decodes"
            )
        return self._loads

    # -- completion ----------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``; failed loads' blocks are stashed.

        Loads of requests in ``finished_req_ids`` (aborted while loading) are
        cancelled and waited for, so vLLM frees their blocks this step. On a step
        without a forward pass (the engine only waits for loads), block up to
        :data:`IDLE_WAIT_S` until every load in flight has landed instead of letting
        the engine spin: the CPU goes to the loads, and requests loaded together are
        scheduled together, in one forward pass.
        """
        cancelled = self.inflight.cancel(finished_req_ids)  # aborted while loading
        if self._idle_step or cancelled:  # idle: every load; else the cancelled ones
            idle = self._idle_step
            self.inflight.wait(
                lambda running: bool(running if idle else cancelled & running), IDLE_WAIT_S
            )
        outcomes = self.inflight.take()
        sending: set[str] = set()
        if self._handoffs is not None:
            sending = self._handoffs.done(finished_req_ids, wait=HOLD_WAIT_S * self._idle_step)
        recving: set[str] = set()
        for out in outcomes:
            recving.add(out.req_id)
            self._report(out)
        return sending, recving

    def _report(self, out: _Outcome) -> None:
        failed = self._failed_recving if self.groups.hybrid else None
        self._worker_meta[out.req_id] = report(out, self.stats, self._invalid_blocks, failed)

    def take_failed_recving(self) -> set[str]:
        """Failed loads of a model with several KV cache groups (vLLM's failed_recving)."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_invalid_block_ids(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_worker_meta(self) -> OmniKVWorkerMetadata | None:
        if not self._worker_meta:
            return None
        out, self._worker_meta = self._worker_meta, {}
        return OmniKVWorkerMetadata(loads=out)

    def take_stats(self) -> OmniKVConnectorStats | None:
        now = time.monotonic()
        if now >= self._held_checked + HELD_EVERY_S:  # the backend's count, once a second
            self._held_checked = now
            try:
                self.stats.set_held(*self.session.held_payloads())
            except Exception as e:
                logger.debug("backend inventory for the held-payload gauge: %s", e)
        if self._handoffs is not None:
            total = self._handoffs.expired
            self.stats.record_leases_expired(total - self._expired_seen)
            self._expired_seen = total
        dropped = self._notices.dropped
        self.stats.record_notices_dropped(dropped - self._dropped_seen)
        self._dropped_seen = dropped
        return self.stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loads is not None:
            self._loads.stop.set()
        self._notices.close()
        self.inflight.stop(
            self._close_backend, self.cfg.recv_timeout + SHUTDOWN_GRACE_S, SHUTDOWN_WAIT_S
        )

    def _close_backend(self) -> None:
        if self._handoffs is not None:
            self._handoffs.close()
        if self._stager is not None:
            self._stager.close()
        try:
            self.session.close()  # ends the transfers a load may still wait on
        except Exception as e:
            logger.warning("closing backend %s: %s", self.cfg.backend_name, e)
