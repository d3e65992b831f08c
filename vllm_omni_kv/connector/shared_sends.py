"""Shared-pages sends: a request's blocks stay with the producer until the consumer copied them.

With a backend that exports the KV cache (:mod:`vllm_omni_kv.backends.cache_region`),
the producer publishes block ids instead of bytes, so vLLM must not reuse the blocks
until the consumer has copied them. ``request_finished`` already keeps them
(``delay_free``); the worker reports the request in ``finished_sending`` only once
vLLM finished it and every hold of its payloads is gone: released by the consumer,
or taken back by the producer after the payload's lease (``send_ttl``, extended
while a consumer waits) ran out with no reader copying, or at once for a request
that finished without a handoff (aborted).

Consumer: :class:`SharedCopy` is the injection plan of a shared-pages payload; it copies
the pages while the payload's stream is open and its hold is taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.metadata import SaveSpec
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.shared_pages import (
    describe_request,
    layer_geometry,
    shared_fields,
)
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.session import TransferSession
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import PayloadStream, Span

if TYPE_CHECKING:
    from vllm_omni_kv.connector.receive import LayerCache

logger = init_logger(__name__)

#: how often an idle producer checks its holds while it waits for consumers
POLL_S = 0.005


@dataclass
class _Held:
    holds: list[tuple[str, str]]  # (payload key, hold)
    deadline: float
    finished: bool = False  # vLLM finished the request (its blocks wait for us)
    withdrawn: bool = False  # finished without a handoff: take the holds back now


class SharedSends:
    """Producer: requests whose blocks consumers copy out of this process's cache."""

    def __init__(
        self, session: TransferSession, region: CacheRegion, ttl: float, desc: dict[str, Any]
    ) -> None:
        self.session = session
        self.region = region
        self.ttl = ttl
        self.desc = desc  # {"region", "geometry"} of every payload
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls,
        session: TransferSession,
        region: CacheRegion,
        layers: Sequence[LayerCache],
        paged_blocks: bool,
        cfg: OmniKVConfig,
    ) -> SharedSends | None:
        """Shared-pages sends of this worker's cache; None (with a warning: packed payloads
        are sent instead) when the cache is not in the region or TP sizes differ."""
        caches = [x.cache for x in layers]
        got = region.export(caches) if paged_blocks else None
        geometry = None if got is None else layer_geometry(caches, got[1], got[2])
        if got is None or geometry is None:
            logger.warning(
                "OmniKVConnector: backend %s exports the KV cache, but this engine's cache "
                "is not in its region (%s): sending packed payloads instead",
                cfg.backend_name,
                "different TP sizes" if not paged_blocks else "allocated elsewhere",
            )
            return None
        return cls(session, region, cfg.send_ttl, {"region": got[0], "geometry": geometry})

    def payload(
        self, spec: SaveSpec, layers: Sequence[LayerCache], hold: str, md: dict[str, Any]
    ) -> KVCacheTransferData:
        """The shared-pages payload of ``spec`` under ``hold``."""
        self.region.ready([x.cache for x in layers])
        return describe_request(
            spec.transfer_id,
            spec.block_ids,
            spec.num_tokens,
            [x.cache for x in layers],
            layers[0].ident,
            {**self.desc, "hold": hold},
            digests=self.region.digests,
            metadata=md,
        )

    def hold(self, key: str) -> str:
        s = self.session
        return self.region.hold(s.from_stage, s.to_stage, key)

    def add(self, req_id: str, holds: list[tuple[str, str]]) -> None:
        with self._lock:
            self._held[req_id] = _Held(holds, time.monotonic() + self.ttl)

    def withdraw(self, req_ids: Sequence[str]) -> None:
        """These requests finished without a handoff: nobody will read their payloads."""
        s = self.session
        with self._lock:
            held = [(r, self._held[r]) for r in req_ids if r in self._held]
            for _r, h in held:
                h.withdrawn = h.finished = True
        for _r, h in held:
            for key, _hold in h.holds:
                try:
                    s.backend.cleanup(key)
                except Exception as e:
                    logger.debug("withdrawing %s: %s", key, e)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def done(self, finished_req_ids: set[str], wait: float = 0.0) -> set[str]:
        """Requests whose blocks vLLM may free now (finished here, every hold gone).

        ``wait``: on an engine step with nothing to compute, wait up to this long for a
        hold to go (checking every :data:`POLL_S`) instead of letting the engine spin
        through empty steps while it only waits for consumers."""
        until = time.monotonic() + wait
        while True:
            out = self._done(finished_req_ids)
            finished_req_ids = set()
            with self._lock:
                waiting = any(h.finished for h in self._held.values())
            if out or not waiting or time.monotonic() + POLL_S > until:
                return out
            time.sleep(POLL_S)

    def _done(self, finished_req_ids: set[str]) -> set[str]:
        now = time.monotonic()
        out: set[str] = set()
        s = self.session
        with self._lock:
            for r in finished_req_ids & set(self._held):
                self._held[r].finished = True
            items = [(r, h) for r, h in self._held.items() if h.finished]
        for req_id, h in items:
            left = []
            for key, hold in h.holds:
                if self.region.released(hold):
                    continue
                expired = h.withdrawn or now >= h.deadline
                if expired:
                    extended = self._extended(key)
                    if extended is not None and extended > now and not h.withdrawn:
                        h.deadline = extended  # a waiting consumer asked for more time
                        expired = False
                if expired and self.region.take_back(hold):
                    if not h.withdrawn:
                        s.backend.cleanup(key)  # the unclaimed descriptor, if still there
                        logger.info(
                            "took back the blocks of %s: no consumer copied them within "
                            "send_ttl=%gs",
                            req_id,
                            self.ttl,
                        )
                    continue
                left.append((key, hold))
            h.holds = left
            if not left:
                out.add(req_id)
        with self._lock:
            for r in out:
                self._held.pop(r, None)
        return out

    def _extended(self, key: str) -> float | None:
        s = self.session
        try:
            return s.backend.held_until(s.from_stage, s.to_stage, key)
        except Exception:
            return None

    def close(self) -> None:
        """Take back every hold (the engine is stopping; its cache goes away)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            for _key, hold in h.holds:
                self.region.take_back(hold)


class SharedCopy:
    """Injection plan of a shared-pages payload: copy the pages from the producer's cache."""

    def __init__(
        self,
        payload: dict[str, Any],
        region: CacheRegion | None,
        caches: Sequence[torch.Tensor],
        ident: KVLayoutId,
        block_ids: Sequence[int],
        first_block: int,
        verify: bool,
    ) -> None:
        if region is None:
            raise KVPayloadError(
                "received a shared-pages payload but this engine's backend exports no cache "
                "region: configure both stages with the same backend"
            )
        meta, self.shared, self.src_ids = shared_fields(payload)
        if meta.kv_layout != ident:
            raise KVPayloadError(
                f"shared pages of {meta.kv_layout.describe() if meta.kv_layout else '?'} cannot "
                f"be copied into {ident.describe()}: serve both stages with the same KV layout"
            )
        if meta.num_layers != len(caches):
            raise KVPayloadError(f"payload has {meta.num_layers} layers, this engine {len(caches)}")
        n = meta.num_blocks
        if len(block_ids) < n:
            raise KVPayloadError(f"payload spans {n} blocks, the request has {len(block_ids)}")
        self.region, self.caches, self.ident = region, caches, ident
        self.pairs = list(zip(self.src_ids[first_block:n], block_ids[first_block:n], strict=True))
        self.first = first_block
        self.verify = verify
        self.tokens = max(0, meta.num_tokens - first_block * meta.block_size)
        self.moved = 0

    def spans(self, frame_address: int | None) -> list[Span] | None:
        return []  # the frame carries no KV bytes

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        if not self.pairs:
            self.region.release(str(self.shared.get("hold")))
            return self.tokens
        with self.region.reading(self.shared.get("hold")):
            self.moved = self.region.copy_into(
                self.shared.get("region"),
                self.shared.get("geometry"),
                self.ident,
                self.caches,
                self.pairs,
                self.shared.get("sums") if self.verify else None,
                self.first,
            )
            if self.caches[0].device.type == "cuda":  # the blocks are read before the
                torch.cuda.current_stream().synchronize()  # hold goes back
        return self.tokens
