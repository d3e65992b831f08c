"""Worker half of :class:`OmniKVConnector`: moves KV between paged blocks and a transfer session.

Send (producer): in ``wait_for_save`` every request whose prefill completed this
step becomes one payload per target rank, in the paged-blocks format (the
layers' blocks as the cache holds them) or token-major (heterogeneous TP or
``transfer_format``), gathered lazily straight into the backend's buffer (one
copy). Each frame is verified per paged block, so a consumer can check exactly
the blocks it reads. The request is reported in ``finished_sending`` once vLLM
says it finished. Payloads live by leases (:mod:`.send_leases`): withdrawn by a
timer ``send_ttl`` after sending unless a waiting consumer extended them.

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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.connector.affinity import background_cpus, describe, spawn_on
from vllm_omni_kv.connector.compat import COMPAT_KEY, engine_compat
from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.engine_layout import EngineLayout, engine_layout
from vllm_omni_kv.connector.metadata import (
    DiscardSpec,
    LoadSpec,
    OmniKVConnectorMetadata,
    OmniKVWorkerMetadata,
    SaveSpec,
)
from vllm_omni_kv.connector.outcome import Outcome as _Outcome
from vllm_omni_kv.connector.outcome import report
from vllm_omni_kv.connector.receive import LayerCache, layer_caches, receive, token_caches
from vllm_omni_kv.connector.send_leases import SendLeases, extend_payload
from vllm_omni_kv.connector.shared_sends import SharedSends
from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.errors import (
    ConfigError,
    KVPayloadError,
    KVTransferCancelled,
    KVTransferTimeout,
    OmniKVError,
)
from vllm_omni_kv.kvcache.device_staging import DeviceStager
from vllm_omni_kv.kvcache.kv_utils import KVTPTopology, get_local_tp_rank, get_tp_world_size
from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks
from vllm_omni_kv.kvcache.token_major import extract_request_kv
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.parts import split_payload
from vllm_omni_kv.transfer.session import SessionPolicy, TransferSession, sender_endpoint
from vllm_omni_kv.wire.payload import KVCacheTransferData

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

#: longest wait for loads to land on an engine step that has nothing else to do
IDLE_WAIT_S = 0.1
#: longest wait for a consumer to release held blocks on a step with nothing to compute
#: (short: a new request arriving meanwhile waits for the next step)
HOLD_WAIT_S = 0.02
#: how often the payloads-held gauge asks the backend
HELD_EVERY_S = 1.0


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
        self.block_size = int(vllm_config.cache_config.block_size)
        self.compat = engine_compat(vllm_config)
        self.tp_rank = get_local_tp_rank()
        self.tp_size = get_tp_world_size()
        self.target_tp_size = cfg.target_tp_size or self.tp_size
        spec = cfg.backend
        if "local_rank" not in spec.extra:  # per-rank side-channel ports (network backends)
            spec = ConnectorSpec(spec.name, {**spec.extra, "local_rank": self.tp_rank})
        cpus = background_cpus(cfg.transfer_cpus)
        if cpus is not None:
            logger.info("OmniKVConnector: transfer threads run on CPUs %s", describe(cpus))
        try:
            with spawn_on(cpus):  # the backend's threads (side channel, engine I/O)
                backend = OmniConnectorFactory.create_connector(spec)
        except OmniKVError as e:
            raise type(e)(f"kv_connector_extra_config.backend {cfg.backend.name!r}: {e}") from e
        policy = SessionPolicy(
            cfg.poll_interval, cfg.max_poll_interval, max_part_bytes=cfg.max_part_bytes
        )
        self.session = TransferSession(backend, cfg.from_stage, cfg.to_stage, policy, auth=cfg.auth)
        cfg.log_trust()
        self.layers: list[LayerCache] = []
        self.paged_blocks = False
        self.stats = OmniKVConnectorStats()
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # a load finished
        self._idle_step = False
        self._stop = threading.Event()
        # load threads stay with the worker: they copy into its cache, and on spare cores
        # they slowed the forward passes (measured with benchmarks/pd_bench.py)
        self._pool = ThreadPoolExecutor(
            max_workers=cfg.load_threads, thread_name_prefix="omnikv-recv"
        )
        self._inflight: dict[str, tuple[Future[_Outcome], threading.Event]] = {}
        self._outcomes: list[_Outcome] = []
        self._sent_unreported: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._worker_meta: dict[str, dict[str, Any]] = {}
        self._leases = SendLeases(self.session, cfg.send_ttl)  # payloads sent, until send_ttl
        self._expired_seen = 0
        self._closed = False
        self._held_checked = 0.0
        self._stager: DeviceStager | None = None  # CUDA caches: one staging buffer per device
        self._region = backend.cache_region  # consumers copy pages out of our cache
        self._shared: SharedSends | None = None  # set once the cache is in the region

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """Where vLLM allocates the KV cache: the backend's exportable region, if any."""
        return None if self._region is None else self._region.allocation_context()

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.engine is None:
            self.engine = engine_layout(self.vllm_config, self.kv_cache_config)
        self.layers = layer_caches(kv_caches, self.engine)
        fmt = self.cfg.transfer_format
        self.paged_blocks = fmt != "token_major" and self.target_tp_size == self.tp_size
        if fmt == "paged_blocks" and not self.paged_blocks:
            raise ConfigError(
                "kv_connector_extra_config.transfer_format 'paged_blocks' needs equal producer "
                "and consumer TP sizes; use 'auto'"
            )
        if not self.paged_blocks and any(x.kv is None for x in self.layers):
            raise ConfigError(
                f"this engine's KV cache ({self.layers[0].ident.describe()}) has no per-token "
                "K/V view, which token-major transfers (different TP sizes, or "
                "transfer_format 'token_major') need: use equal TP sizes and 'auto'"
            )
        dev = self.layers[0].cache.device if self.layers else None
        if dev is not None and dev.type == "cuda" and self.paged_blocks and self.cfg.staging_bytes:
            self._stager = DeviceStager(dev, self.cfg.staging_bytes)
        if self._region is not None and self.layers:
            self._shared = SharedSends.create(
                self.session, self._region, self.layers, self.paged_blocks, cfg=self.cfg
            )
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
        if hold and self._shared is not None:
            return self._shared.payload(spec, self.layers, hold, md), ident.page_bytes
        if self.paged_blocks:
            data = extract_request_blocks(
                spec.transfer_id,
                spec.block_ids,
                spec.num_tokens,
                [x.cache for x in self.layers],
                layout=ident,
                metadata=md,
                stager=self._stager,
            )
            return data, ident.page_bytes
        data = extract_request_kv(
            spec.transfer_id,
            spec.block_ids,
            spec.num_tokens,
            token_caches(self.layers),
            metadata=md,
        )
        return data, ident.page_bytes // 2

    def _send(self, spec: SaveSpec) -> bool:
        """Publish the request's payloads; True when they name blocks of this cache."""
        t0 = time.perf_counter()
        shared = self._shared
        holds: list[tuple[str, str]] = []
        try:
            topo = KVTPTopology(self.tp_size, self.target_tp_size, self.tp_rank)
            total = 0
            for key in self.session.send_keys(spec.transfer_id, topo):
                if shared is not None:
                    holds.append((key, shared.hold(key)))
                data, chunk = self._payload(spec, holds[-1][1] if holds else "")
                total += self.session.send(key, data, chunk_bytes=chunk)
                self._leases.add(key, len(split_payload(data, self.session.part_limit())))
            if shared is not None:
                shared.add(spec.req_id, holds)
        except Exception as e:  # the consumer will time out and recompute
            for _key, hold in holds:
                self._release_hold(hold=hold)
            self.stats.record_send(0, 0.0, ok=False)
            logger.error(
                "OmniKVConnector: sending the KV of request %s failed: %s; the consumer will "
                "recompute it after recv_timeout",
                spec.req_id,
                e,
                exc_info=not isinstance(e, OmniKVError),
            )
            return False
        dt = time.perf_counter() - t0
        self.stats.record_send(total, dt, ok=True)
        logger.debug(
            "sent %d tokens of %s: %d bytes in %.2f ms",
            spec.num_tokens,
            spec.req_id,
            total,
            dt * 1e3,
        )
        return shared is not None

    def wait_for_save(self, meta: OmniKVConnectorMetadata | None) -> None:
        if meta is not None and meta.saves:
            for spec in meta.saves:
                if not self._send(spec):  # shared pages are reported once copied
                    with self._lock:
                        self._sent_unreported.add(spec.req_id)

    # -- receive -------------------------------------------------------------------------
    def start_load_kv(self, meta: OmniKVConnectorMetadata | None, idle_step: bool = False) -> None:
        self._idle_step = idle_step
        if meta is None or self._closed:
            return
        now = time.monotonic()
        for d in meta.discards:
            self._pool.submit(self._discard, d)
        for d in meta.extends:
            self._pool.submit(self._extend, d)
        if meta.withdraws and self._shared is not None:
            self._shared.withdraw(meta.withdraws)
        for spec in meta.loads:
            cancel = threading.Event()
            fut = self._pool.submit(self._load, spec, now + self.cfg.recv_timeout, cancel)
            with self._lock:
                self._inflight[spec.req_id] = (fut, cancel)
            fut.add_done_callback(functools.partial(self._done, spec))

    def _done(self, spec: LoadSpec, fut: Future[_Outcome]) -> None:
        try:
            out = fut.result()
        except BaseException as e:  # cancelled at shutdown, or a bug
            out = self._failed(spec, f"load aborted: {e!r}", 0.0)
        with self._lock:
            self._inflight.pop(spec.req_id, None)
            self._outcomes.append(out)
            self._landed.notify_all()

    def _topology(self, source_tp: int | None) -> KVTPTopology:
        return KVTPTopology(
            source_tp or self.cfg.source_tp_size or self.tp_size, self.tp_size, self.tp_rank
        )

    def _failed(self, spec: LoadSpec, why: str, dt: float, **flags: bool) -> _Outcome:
        first = spec.num_local_tokens // self.block_size
        n_blocks = -(-(spec.num_local_tokens + spec.num_load_tokens) // self.block_size)
        return _Outcome(
            spec.req_id,
            ok=False,
            block_ids=list(spec.block_ids[first:n_blocks]),
            seconds=dt,
            error=why,
            **flags,
        )

    def _load(self, spec: LoadSpec, deadline: float, cancel: threading.Event) -> _Outcome:
        t0 = time.monotonic()
        topo = self._topology(spec.source_tp_size)
        keys = self.session.recv_keys(spec.transfer_id, topo)
        endpoints = [sender_endpoint(spec.remote_host, spec.remote_port, r) for _k, r in keys]
        try:
            if self._stop.is_set():
                raise KVTransferCancelled("the connector is shutting down")
            got = receive(
                self.session,
                self.layers,
                spec,
                [(k, ep) for (k, _r), ep in zip(keys, endpoints, strict=True)],
                topo,
                deadline,
                cancel,
                self.compat,
                self._region,
            )
        except KVTransferCancelled as e:
            for (key, _r), ep in zip(keys, endpoints, strict=True):  # tell the producer
                try:
                    self._release_hold(key)
                    self.session.discard(key, ep)
                except Exception as err:  # best effort: the producer expires it anyway
                    logger.debug("discarding %s after cancel: %s", key, err)
            return self._failed(spec, str(e), time.monotonic() - t0, cancelled=True)
        except KVTransferTimeout as e:
            why = f"{e} (within recv_timeout={self.cfg.recv_timeout:g}s)"
            return self._failed(spec, why, time.monotonic() - t0, timed_out=True)
        except KVPayloadError as e:  # the payload was refused (prompt, model, layout, bytes)
            why = f"{type(e).__name__}: {e}"
            return self._failed(spec, why, time.monotonic() - t0, refused=True)
        except OmniKVError as e:
            return self._failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        except Exception as e:
            logger.exception("unexpected error loading the KV of request %s", spec.req_id)
            return self._failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        return _Outcome(
            spec.req_id,
            ok=True,
            tokens=got.tokens,
            nbytes=got.moved,
            seconds=time.monotonic() - t0,
            write_seconds=got.write_seconds,
        )

    def _discard(self, d: DiscardSpec) -> None:
        """A full local prefix hit: tell the producer its payload is not needed (nothing moves)."""
        try:
            topo = self._topology(d.source_tp_size)
            for key, from_rank in self.session.recv_keys(d.transfer_id, topo):
                ep = sender_endpoint(d.remote_host, d.remote_port, from_rank)
                self._release_hold(key)
                if self.session.discard(key, ep):
                    logger.debug("request %s is fully cached here: released %s", d.req_id, key)
        except Exception as e:  # best effort: the producer expires it after send_ttl
            logger.debug("discarding the payload of %s: %s", d.req_id, e)

    def _release_hold(self, key: str = "", hold: str = "") -> None:
        """A payload that will not be read: release its hold (by key or name), if any."""
        if self._region is not None:
            s = self.session
            self._region.release(hold or self._region.hold_name(s.from_stage, s.to_stage, key))

    def _extend(self, d: DiscardSpec) -> None:
        """A request waiting here for blocks: extend its payload's lease at the producer."""
        try:
            topo = self._topology(d.source_tp_size)
            for key, from_rank in self.session.recv_keys(d.transfer_id, topo):
                ep = sender_endpoint(d.remote_host, d.remote_port, from_rank)
                if extend_payload(self.session, key, ep, self.cfg.send_ttl):
                    logger.debug("request %s waits: extended the lease of %s", d.req_id, key)
        except Exception as e:  # best effort: without it the payload expires after send_ttl
            logger.debug("extending the payload lease of %s: %s", d.req_id, e)

    # -- completion ----------------------------------------------------------------------
    def _cancel_finished(self, finished_req_ids: set[str]) -> bool:
        """Cancel the loads of requests vLLM finished (aborted); True when any was."""
        hit = False
        for req_id in finished_req_ids & set(self._inflight):
            self._inflight[req_id][1].set()
            hit = True
        return hit

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``; failed loads' blocks are stashed.

        Loads of requests in ``finished_req_ids`` (aborted while loading) are
        cancelled and waited for, so vLLM frees their blocks this step. On a step
        without a forward pass (the engine only waits for loads), block up to
        :data:`IDLE_WAIT_S` until every load in flight has landed instead of letting
        the engine spin: the CPU goes to the loads, and requests loaded together are
        scheduled together, in one forward pass.
        """
        with self._lock:
            cancelled = self._cancel_finished(finished_req_ids)
            if self._inflight and (self._idle_step or cancelled):
                deadline = time.monotonic() + IDLE_WAIT_S

                def pending() -> bool:  # idle: every load; else the cancelled ones
                    if self._idle_step:
                        return bool(self._inflight)
                    return bool(finished_req_ids & set(self._inflight))

                while pending() and (left := deadline - time.monotonic()) > 0:
                    self._landed.wait(left)
            sending = self._sent_unreported & finished_req_ids
            self._sent_unreported -= sending
            outcomes, self._outcomes = self._outcomes, []
        if self._shared is not None:
            sending |= self._shared.done(finished_req_ids, wait=HOLD_WAIT_S * self._idle_step)
        recving: set[str] = set()
        for out in outcomes:
            recving.add(out.req_id)
            self._report(out)
        return sending, recving

    def _report(self, out: _Outcome) -> None:
        self._worker_meta[out.req_id] = report(out, self.stats, self._invalid_blocks)

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
                health = self.session.backend.health()
                held = int(health.get("unconsumed", health.get("exposed_keys", 0)))
                self.stats.set_held(held, int(health.get("held_bytes", 0)))
            except Exception as e:
                logger.debug("backend health for the held-payload gauge: %s", e)
        expired, self._expired_seen = (
            self._leases.expired - self._expired_seen,
            self._leases.expired,
        )
        self.stats.record_leases_expired(expired)
        return self.stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            for _fut, cancel in self._inflight.values():
                cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._leases.close()
        if self._shared is not None:
            self._shared.close()
        if self._stager is not None:
            self._stager.close()
        try:
            self.session.backend.close()
        except Exception as e:
            logger.warning("closing backend %s: %s", self.cfg.backend_name, e)
