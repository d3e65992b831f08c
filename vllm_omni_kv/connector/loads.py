"""Consumer: one request's load, run on a worker's load thread, and its outcome.

A load polls the session for the request's payload (bounded by ``recv_timeout`` from
when it was scheduled), checks it against the request and writes just the tokens the
consumer lacks (:mod:`.receive`). Every load ends in an :class:`Outcome`; a failed
one names the blocks vLLM must recompute. A request fully cached here discards its
payload; one waiting for blocks extends the payload's lease at the producer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.connector.compat import CompatIdentity
from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.metadata import LoadSpec, RemotePayload
from vllm_omni_kv.connector.outcome import Outcome as _Outcome
from vllm_omni_kv.connector.receive import LayerCache, receive
from vllm_omni_kv.connector.state_layers import StateLayer
from vllm_omni_kv.errors import (
    KVPayloadError,
    KVTransferCancelled,
    KVTransferTimeout,
    OmniKVError,
)
from vllm_omni_kv.kvcache import page_kernel
from vllm_omni_kv.kvcache.device_order import DeviceEvent
from vllm_omni_kv.kvcache.kv_utils import KVTPTopology
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.session import TransferSession, sender_endpoint

logger = init_logger(__name__)

#: the most seconds one notice (a discard or an extension) spends on its ranks' producers
NOTICE_BUDGET_S = 10.0


class LoadRunner:
    """Runs the loads, discards and lease extensions of one consumer worker."""

    def __init__(
        self,
        session: TransferSession,
        cfg: OmniKVConfig,
        layers: Sequence[LayerCache],
        tp: tuple[int, int],
        block_size: int,
        compat: CompatIdentity | None,
        states: Sequence[StateLayer] = (),
    ) -> None:
        """``tp``: this worker's ``(rank, size)``; ``states``: the state layers of a hybrid
        model (after ``layers`` in a payload)."""
        self.session, self.cfg, self.layers, self.states = session, cfg, layers, states
        self.tp_rank, self.tp_size = tp
        self.block_size = block_size
        self.compat = compat
        self.region: CacheRegion | None = session.cache_region
        self.stop = threading.Event()
        dev = layers[0].cache.device if layers else None
        if (
            dev is not None
            and dev.type == "cuda"
            and self.region
            and self.region.kind == "cuda_ipc"
        ):
            page_kernel.warm_up(dev)  # compiled now, not in the first load (off if it fails)

    def topology(self, source_tp: int | None) -> KVTPTopology:
        return KVTPTopology(
            source_tp or self.cfg.source_tp_size or self.tp_size, self.tp_size, self.tp_rank
        )

    def failed(
        self,
        spec: LoadSpec,
        why: str,
        dt: float,
        *,
        timed_out: bool = False,
        refused: bool = False,
        cancelled: bool = False,
    ) -> _Outcome:
        return _Outcome(
            spec.req_id,
            ok=False,
            block_ids=self.blocks(spec),
            seconds=dt,
            error=why,
            timed_out=timed_out,
            refused=refused,
            cancelled=cancelled,
        )

    def blocks(self, spec: LoadSpec) -> list[int]:
        """The blocks ``spec`` writes (what vLLM recomputes when the load fails)."""
        first = spec.num_local_tokens // self.block_size
        n_blocks = -(-(spec.num_local_tokens + spec.num_load_tokens) // self.block_size)
        return list(spec.block_ids[first:n_blocks])

    def load(
        self,
        spec: LoadSpec,
        deadline: float,
        cancel: threading.Event,
        after: DeviceEvent | None = None,
    ) -> _Outcome:
        """Run one load; its writes into a device cache run after ``after`` (the event
        ``start_load_kv`` recorded on the forward stream)."""
        topo = self.topology(spec.source_tp_size)
        keys = self.session.recv_keys(spec.transfer_id, topo)
        out = self._load(spec, deadline, cancel, topo, keys, after)
        if not out.ok:  # this consumer will not read it: the producer's blocks may go now
            for key, _rank in keys:
                try:
                    self.session.release_hold(key)
                except Exception as err:  # best effort: the producer's lease ends it anyway
                    logger.debug("releasing the hold of %s: %s", key, err)
        return out

    def _load(
        self,
        spec: LoadSpec,
        deadline: float,
        cancel: threading.Event,
        topo: KVTPTopology,
        keys: list[tuple[str, int | None]],
        after: DeviceEvent | None,
    ) -> _Outcome:
        t0 = time.monotonic()
        endpoints = [sender_endpoint(spec.remote_host, spec.remote_port, r) for _k, r in keys]
        try:
            if self.stop.is_set():
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
                after,
                self.states,
            )
        except KVTransferCancelled as e:
            for (key, _r), ep in zip(keys, endpoints, strict=True):  # tell the producer
                try:
                    self.session.discard(key, ep)
                except Exception as err:  # best effort: the producer expires it anyway
                    logger.debug("discarding %s after cancel: %s", key, err)
            return self.failed(spec, str(e), time.monotonic() - t0, cancelled=True)
        except KVTransferTimeout as e:
            why = f"{e} (within recv_timeout={self.cfg.recv_timeout:g}s)"
            return self.failed(spec, why, time.monotonic() - t0, timed_out=True)
        except KVPayloadError as e:  # the payload was refused (prompt, model, layout, bytes)
            why = f"{type(e).__name__}: {e}"
            return self.failed(spec, why, time.monotonic() - t0, refused=True)
        except OmniKVError as e:
            return self.failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        except Exception as e:
            logger.exception("unexpected error loading the KV of request %s", spec.req_id)
            return self.failed(spec, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        return _Outcome(
            spec.req_id,
            ok=True,
            block_ids=self.blocks(spec),  # a failure after all, should sleep discard them
            tokens=got.tokens,
            nbytes=got.moved,
            seconds=time.monotonic() - t0,
            write_seconds=got.write_seconds,
            format=got.format,
            transport=self.session.transport(),
        )

    def discard(self, d: RemotePayload) -> None:
        """A full local prefix hit: tell the producer its payload is not needed (nothing moves)."""
        try:
            topo = self.topology(d.source_tp_size)
            until = time.monotonic() + NOTICE_BUDGET_S
            for key, from_rank in self.session.recv_keys(d.transfer_id, topo):
                ep = sender_endpoint(d.remote_host, d.remote_port, from_rank)
                try:  # the payload goes before its hold: a released hold means nothing left
                    if time.monotonic() < until and self.session.discard(key, ep):
                        logger.debug("request %s needs no load: released %s", d.req_id, key)
                finally:
                    self.session.release_hold(key)
        except Exception as e:  # best effort: the producer expires it after send_ttl
            logger.debug("discarding the payload of %s: %s", d.req_id, e)

    def extend(self, d: RemotePayload) -> None:
        """A request waiting here for blocks: extend its payload's lease at the producer."""
        try:
            topo = self.topology(d.source_tp_size)
            until = time.monotonic() + NOTICE_BUDGET_S
            for key, from_rank in self.session.recv_keys(d.transfer_id, topo):
                ep = sender_endpoint(d.remote_host, d.remote_port, from_rank)
                if time.monotonic() >= until:
                    break  # its producers answer slowly: the rest expire by their leases
                if self.session.extend(key, ep, self.cfg.send_ttl):
                    logger.debug("request %s waits: extended the lease of %s", d.req_id, key)
        except Exception as e:  # best effort: without it the payload expires after send_ttl
            logger.debug("extending the payload lease of %s: %s", d.req_id, e)
