"""Producer: this worker's KV cache exported through the backend's cache region.

With a backend that exports the KV cache (:mod:`vllm_omni_kv.backends.cache_region`),
the producer publishes block ids instead of bytes: a shared-pages payload naming the
region, the layers' geometry in it and the request's blocks (and, for a hybrid model,
each state layer's page: :mod:`~vllm_omni_kv.kvcache.shared_states`), under a hold that
keeps the blocks until the consumer copied them (:mod:`.handoff` owns that lifetime).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.connector.kv_groups import shared_tables
from vllm_omni_kv.connector.metadata import SaveSpec
from vllm_omni_kv.connector.receive import LayerCache
from vllm_omni_kv.connector.state_layers import StateLayer, state_sources
from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry
from vllm_omni_kv.kvcache.shared_states import (
    STATES,
    describe_states,
    state_geometry,
    state_view,
)
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.payload import KVCacheTransferData

logger = init_logger(__name__)


class PageExport:
    """The exported cache of one producer worker and the payloads that name its pages."""

    def __init__(
        self,
        region: CacheRegion,
        desc: dict[str, Any],
        states: Sequence[StateLayer] = (),
        state_geometry: list[list[Any]] | None = None,
    ) -> None:
        self.region = region
        self.desc = desc  # {"region", "geometry"} of every payload
        self.states = list(states)  # a hybrid model's state layers
        self.state_geometry = state_geometry or []  # where their views lie in the region

    @classmethod
    def create(
        cls,
        region: CacheRegion,
        layers: Sequence[LayerCache],
        backend_name: str,
        states: Sequence[StateLayer] = (),
    ) -> PageExport | None:
        """The export of ``layers`` (and ``states``); None (logged once: packed payloads
        are sent instead) where the region cannot export them (a device cache it cannot
        register)."""
        caches = [x.cache for x in layers]
        got = region.export(caches + [state_view(s.pages) for s in states])
        geometry = None if got is None else layer_geometry(caches, got[1], got[2])
        pages = [s.pages for s in states]
        states_at = None if got is None else state_geometry(pages, got[1], got[2])
        if got is None or geometry is None or states_at is None:
            logger.warning(
                "OmniKVConnector: backend %s cannot export this engine's KV cache (on %s): "
                "sending packed payloads instead",
                backend_name,
                caches[0].device if caches else "?",
            )
            return None
        logger.info(
            "OmniKVConnector: backend %s exports this engine's KV cache (%d attention and %d "
            "state layers): payloads name its pages, consumers copy them out (one copy)",
            backend_name,
            len(layers),
            len(states),
        )
        return cls(region, {"region": got[0], "geometry": geometry}, states, states_at)

    def ready(self, layers: Sequence[LayerCache]) -> None:
        """Return once the pages of ``layers`` are final: called once per step, before
        that step's payloads are published (a device cache waits for the forward)."""
        self.region.ready([x.cache for x in layers])

    def payload(
        self, spec: SaveSpec, layers: Sequence[LayerCache], hold: str, md: dict[str, Any]
    ) -> KVCacheTransferData:
        """The shared-pages payload of ``spec`` under ``hold`` (after :meth:`ready`)."""
        shared = {**self.desc, "hold": hold}
        if self.states:
            sources = state_sources(self.states, spec)
            shared[STATES], layouts = describe_states(
                sources, self.state_geometry, len(layers), self.region.digests
            )
            md = {**md, **layouts}
        return describe_request(
            spec.transfer_id,
            spec.block_ids,
            spec.num_tokens,
            [x.cache for x in layers],
            layers[0].ident,
            shared,
            digests=self.region.digests,
            metadata=md,
            groups=shared_tables(spec, layers),
        )


def export_pages(
    region: CacheRegion,
    layers: Sequence[LayerCache],
    backend_name: str,
    refusal: str | None,
    states: Sequence[StateLayer] = (),
) -> PageExport | None:
    """The one-copy export of a producer's cache in ``region``, or None, said once (the
    producer then sends packed payloads) where it cannot be: ``refusal``, the region
    unavailable, or the model runner never entered the allocation context.
    ``ConfigError`` when vLLM allocated the cache outside the region it asked for."""
    caches = [x.cache for x in layers] + [state_view(s.pages) for s in states]
    why = region.unavailable_reason or refusal
    if why is None and region.context_entered() is False:
        why = "this model runner never entered get_mem_pool_context (the cache is vLLM's)"
    if why is not None:
        logger.warning(
            "OmniKVConnector: backend %s sends packed payloads, not pages of this "
            "engine's cache: %s",
            backend_name,
            why,
        )
        return None
    if caches[0].device.type == region.places:  # the region placed it: verify that
        region.check_placement(caches)
    return PageExport.create(region, layers, backend_name, states)
