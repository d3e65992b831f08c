"""Worker half of :class:`OmniKVConnector`: moves KV between paged blocks and a backend.

Send (producer): in ``wait_for_save`` every request whose prefill completed
this step is laid out as one frame per target rank; its per-layer K/V tensors
are :class:`~vllm_omni_kv.transfer.codec.LazyTensor` s gathered straight from
the paged blocks into the backend's buffer (one copy). The put is synchronous,
so the request is reported in ``finished_sending`` as soon as vLLM says it
finished.

Receive (consumer): ``start_load_kv`` hands each load to a background thread
that polls the backend (with backoff) until the payload is there or the
deadline ``recv_timeout`` after the load was scheduled has passed, verifies
it (frame checksum, prompt digest, token count, layer count, shapes, dtype)
and scatters the missing tokens into the request's blocks. Every load ends in
``finished_recving``; a failed one also reports its blocks from
``get_block_ids_with_load_errors`` so vLLM recomputes (or fails) the request.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.connector.affinity import (
    background_cpus,
    describe,
    spawn_on,
)
from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.metadata import (
    DiscardSpec,
    LoadSpec,
    OmniKVConnectorMetadata,
    OmniKVWorkerMetadata,
    SaveSpec,
)
from vllm_omni_kv.connector.payload import LayerCache, build_payload, inject_payload
from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.errors import (
    ConfigError,
    KVPayloadError,
    KVTransferError,
    KVTransferTimeout,
    OmniKVError,
)
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer import codec
from vllm_omni_kv.transfer.config import ConnectorSpec
from vllm_omni_kv.transfer.kv_utils import (
    KVTPTopology,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    detect_kv_layout,
    get_local_tp_rank,
    get_tp_world_size,
    merge_received_rank_shards,
    normalize_layer_kv,
    slice_received_rank_shard,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

#: longest wait for loads to land on an engine step that has nothing else to do
IDLE_WAIT_S = 0.1


@dataclass
class _Outcome:
    req_id: str
    ok: bool
    block_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    timed_out: bool = False


class OmniKVWorker:
    """State of one worker process (one TP rank)."""

    def __init__(self, vllm_config: VllmConfig, cfg: OmniKVConfig, engine_id: str) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
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
                self.backend: OmniConnectorBase = OmniConnectorFactory.create_connector(spec)
        except OmniKVError as e:
            raise type(e)(f"kv_connector_extra_config.backend {cfg.backend.name!r}: {e}") from e
        self.layers: list[LayerCache] = []
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
        self._inflight: dict[str, Future[_Outcome]] = {}
        self._outcomes: list[_Outcome] = []
        self._sent_unreported: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._worker_meta: dict[str, dict[str, Any]] = {}
        self._sent_keys: collections.deque[tuple[float, str]] = collections.deque()
        self._closed = False

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers: list[LayerCache] = []
        for i, (name, cache) in enumerate(kv_caches.items()):
            kv = normalize_layer_kv(cache, layer_idx=i)
            if kv is None:
                raise ConfigError(
                    f"OmniKVConnector cannot read the KV cache layout of layer {name!r} "
                    f"(shape {tuple(getattr(cache, 'shape', ()))}); supported: FlashAttention, "
                    "FlashInfer, (key, value) tuples and vLLM's CPU layout"
                )
            key, value = kv
            if int(key.shape[1]) != self.block_size:
                raise ConfigError(
                    f"layer {name!r}: cache block size {key.shape[1]} != configured "
                    f"block_size {self.block_size}"
                )
            layout = detect_kv_layout(cache)
            raw = cache if layout != "tuple" and cache.is_contiguous() else None
            layers.append(LayerCache(name, key, value, raw, 1 if layout == "flash" else 0, layout))
        self.layers = layers
        if self.cfg.transfer_format == "raw_blocks" and not self._raw_ok():
            raise ConfigError(
                "kv_connector_extra_config.transfer_format 'raw_blocks' needs equal producer and "
                "consumer TP sizes and a single-tensor KV cache per layer; use 'auto'"
            )
        if layers:
            k = layers[0].key
            logger.info(
                "OmniKVConnector worker (tp %d/%d, backend %s): %d layers, %d blocks of %d "
                "tokens, %d kv heads x %d, %s",
                self.tp_rank,
                self.tp_size,
                self.cfg.backend_name,
                len(layers),
                k.shape[0],
                k.shape[1],
                k.shape[2],
                k.shape[3],
                k.dtype,
            )

    # -- send ----------------------------------------------------------------------------
    def _raw_ok(self) -> bool:
        """Raw blocks travel when no head slicing is needed and every layer is one tensor."""
        if self.cfg.transfer_format == "token_major":
            return False
        return self.target_tp_size == self.tp_size and all(x.raw is not None for x in self.layers)

    def _payload(self, spec: SaveSpec) -> dict[str, Any]:
        n = len(spec.block_ids) * self.block_size
        md: dict[str, Any] = {
            "num_tokens": spec.num_tokens,
            "rows": n,
            "prompt_digest": spec.prompt_digest,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "block_size": self.block_size,
            "layer_names": [layer.name for layer in self.layers],
        }
        return build_payload(self.layers, spec, self.block_size, md, self._raw_ok())

    def _inject(self, spec: LoadSpec, payload: dict[str, Any]) -> None:
        inject_payload(self.layers, self.block_size, spec, payload)

    def _send(self, spec: SaveSpec) -> None:
        t0 = time.perf_counter()
        try:
            topo = KVTPTopology(self.tp_size, self.target_tp_size, self.tp_rank)
            keys = build_rank_aware_send_keys(
                spec.transfer_id, self.cfg.from_stage, self.cfg.to_stage, topo
            )
            total = 0
            for key in keys:
                frame = codec.encode(self._payload(spec))
                ok, size, _ = self.backend.put(self.cfg.from_stage, self.cfg.to_stage, key, frame)
                if not ok:
                    raise KVTransferError(f"backend {self.cfg.backend_name} rejected key {key!r}")
                total += int(size)
                self._sent_keys.append((time.monotonic(), key))
        except Exception as e:  # the consumer will time out and recompute
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

    def _expire_sent(self) -> None:
        deadline = time.monotonic() - self.cfg.send_ttl
        while self._sent_keys and self._sent_keys[0][0] < deadline:
            _, key = self._sent_keys.popleft()
            try:
                self.backend.cleanup(key)
            except Exception as e:
                logger.debug("cleanup of %s failed: %s", key, e)

    def wait_for_save(self, meta: OmniKVConnectorMetadata | None) -> None:
        if meta is not None and meta.saves:
            for spec in meta.saves:
                self._send(spec)
                with self._lock:
                    self._sent_unreported.add(spec.req_id)
        if self._sent_keys:
            self._expire_sent()

    # -- receive -------------------------------------------------------------------------
    def start_load_kv(self, meta: OmniKVConnectorMetadata | None, idle_step: bool = False) -> None:
        self._idle_step = idle_step
        if meta is None or self._closed:
            return
        now = time.monotonic()
        for d in meta.discards:
            self._pool.submit(self._discard, d)
        for spec in meta.loads:
            fut = self._pool.submit(self._load, spec, now + self.cfg.recv_timeout)
            with self._lock:
                self._inflight[spec.req_id] = fut
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

    def _remote_md(
        self, host: str | None, port: int | None, from_rank: int | None
    ) -> dict[str, Any] | None:
        if not host or not port:
            return None
        # a sender rank's side channel listens on the advertised base port + its rank
        return {"source_host": host, "source_port": int(port) + int(from_rank or 0)}

    def _poll(self, key: str, md: dict[str, Any] | None, deadline: float) -> tuple[Any, int]:
        delay = self.cfg.poll_interval
        last_err: Exception | None = None
        while True:
            if self._stop.is_set():
                raise KVTransferError("the connector is shutting down")
            try:
                got = self.backend.get(self.cfg.from_stage, self.cfg.to_stage, key, md)
            except KVPayloadError:
                raise
            except KVTransferTimeout as e:  # the backend's own wait ran out; ours decides
                got, last_err = None, e
            except KVTransferError as e:
                got, last_err = None, e
            if got is not None:
                return got
            now = time.monotonic()
            if now >= deadline:
                why = f" (last backend error: {last_err})" if last_err else ""
                raise KVTransferTimeout(
                    f"no KV payload under key {key!r} within recv_timeout={self.cfg.recv_timeout}s"
                    f"{why}; is the producer running and using the same backend "
                    f"({self.cfg.backend_name}) and stage names?"
                )
            self._stop.wait(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * 2, self.cfg.max_poll_interval)

    @staticmethod
    def _as_payload(obj: Any) -> dict[str, Any]:
        if isinstance(obj, dict):
            return obj
        raw = getattr(obj, "tensor", obj)
        if isinstance(raw, (torch.Tensor, bytes, bytearray, memoryview)):
            decoded = codec.decode(raw)
            if isinstance(decoded, dict):
                return decoded
        raise KVPayloadError(f"backend returned a {type(obj).__name__}, not a KV payload")

    def _failed(self, spec: LoadSpec, why: str, dt: float, timed_out: bool = False) -> _Outcome:
        first = spec.num_local_tokens // self.block_size
        n_blocks = -(-(spec.num_local_tokens + spec.num_load_tokens) // self.block_size)
        return _Outcome(
            spec.req_id,
            ok=False,
            block_ids=list(spec.block_ids[first:n_blocks]),
            seconds=dt,
            error=why,
            timed_out=timed_out,
        )

    def _load(self, spec: LoadSpec, deadline: float) -> _Outcome:
        t0 = time.monotonic()
        held: list[Any] = []
        try:
            topo = self._topology(spec.source_tp_size)
            keys = build_rank_aware_recv_keys(
                spec.transfer_id, self.cfg.from_stage, self.cfg.to_stage, topo
            )
            nbytes = 0
            payloads: list[dict[str, Any]] = []
            for key, from_rank in keys:
                obj, size = self._poll(
                    key, self._remote_md(spec.remote_host, spec.remote_port, from_rank), deadline
                )
                held.append(obj)
                payloads.append(self._as_payload(obj))
                nbytes += int(size)
            payload = merge_received_rank_shards(payloads)
            payload = slice_received_rank_shard(payload, topo)
            if payload is None:
                raise KVPayloadError("no payload after merging rank shards")
            self._inject(spec, payload)
        except KVTransferTimeout as e:
            return self._failed(spec, str(e), time.monotonic() - t0, timed_out=True)
        except OmniKVError as e:
            return self._failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        except Exception as e:
            logger.exception("unexpected error loading the KV of request %s", spec.req_id)
            return self._failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        finally:
            for obj in held:
                release = getattr(obj, "release", None)
                if callable(release):
                    try:
                        release()
                    except Exception:
                        pass
        return _Outcome(
            spec.req_id,
            ok=True,
            tokens=spec.num_load_tokens,
            nbytes=nbytes,
            seconds=time.monotonic() - t0,
        )

    def _discard(self, d: DiscardSpec) -> None:
        try:
            topo = self._topology(d.source_tp_size)
            for key, from_rank in build_rank_aware_recv_keys(
                d.transfer_id, self.cfg.from_stage, self.cfg.to_stage, topo
            ):
                got = self.backend.get(
                    self.cfg.from_stage,
                    self.cfg.to_stage,
                    key,
                    self._remote_md(d.remote_host, d.remote_port, from_rank),
                )
                release = getattr(got[0], "release", None) if got else None
                if callable(release):
                    release()
        except Exception as e:  # best effort: the producer expires it after send_ttl
            logger.debug("discarding the payload of %s: %s", d.req_id, e)

    # -- completion ----------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``; failed loads' blocks are stashed.

        On a step without a forward pass (the engine only waits for loads), block up to
        :data:`IDLE_WAIT_S` until every load in flight has landed instead of letting the
        engine spin: the CPU goes to the loads (and to a producer sharing this host), and
        requests loaded together are scheduled together, in one forward pass.
        """
        with self._lock:
            if self._idle_step and self._inflight:
                deadline = time.monotonic() + IDLE_WAIT_S
                while self._inflight and (left := deadline - time.monotonic()) > 0:
                    self._landed.wait(left)
            sending = self._sent_unreported & finished_req_ids
            self._sent_unreported -= sending
            outcomes, self._outcomes = self._outcomes, []
        recving: set[str] = set()
        for out in outcomes:
            recving.add(out.req_id)
            self.stats.record_recv(out.nbytes, out.seconds, out.tokens, out.ok, out.timed_out)
            self._worker_meta[out.req_id] = {
                "ok": out.ok,
                "tokens": out.tokens,
                "bytes": out.nbytes,
                "seconds": round(out.seconds, 6),
                "error": out.error,
            }
            if out.ok:
                logger.debug(
                    "loaded %d tokens of %s: %d bytes in %.2f ms",
                    out.tokens,
                    out.req_id,
                    out.nbytes,
                    out.seconds * 1e3,
                )
            else:
                self._invalid_blocks.update(out.block_ids)
                logger.warning(
                    "OmniKVConnector: KV load of request %s failed after %.2fs: %s; its %d "
                    "blocks are reported invalid (kv_load_failure_policy decides: recompute "
                    "or fail)",
                    out.req_id,
                    out.seconds,
                    out.error,
                    len(out.block_ids),
                )
        return sending, recving

    def take_invalid_block_ids(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_worker_meta(self) -> OmniKVWorkerMetadata | None:
        if not self._worker_meta:
            return None
        out, self._worker_meta = self._worker_meta, {}
        return OmniKVWorkerMetadata(loads=out)

    def take_stats(self) -> OmniKVConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.backend.close()
        except Exception as e:
            logger.warning("closing backend %s: %s", self.cfg.backend_name, e)
