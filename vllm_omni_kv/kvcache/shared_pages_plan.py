"""The injection plan of a shared-pages payload: copy pages out of the producer's cache.

The third plan beside paged blocks and token-major K/V. Its bytes do not travel in
the frame: a :class:`PageSource` (a backend's cache region) copies the request's
pages straight from the producer's exported cache into the local one while the
payload's hold is taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.device_order import settle, streams_of
from vllm_omni_kv.kvcache.layer_windows import LAYER_FIRST_BLOCKS
from vllm_omni_kv.kvcache.meta import PAGED_BLOCKS
from vllm_omni_kv.kvcache.page_groups import GROUPS as SHARED_GROUPS
from vllm_omni_kv.kvcache.page_groups import group_copies
from vllm_omni_kv.kvcache.paged_blocks import KV_BLOCKS
from vllm_omni_kv.kvcache.shared_pages import SHARED, PageCopy, attach_layers, shared_groups
from vllm_omni_kv.kvcache.shared_states import SharedStates, StatePage
from vllm_omni_kv.wire.stream import PayloadStream, Span


class PageSource(Protocol):
    """Where a consumer copies a producer's pages from (a backend's cache region)."""

    def reading(self, hold: Any) -> AbstractContextManager[Any]:
        """Hold ``hold`` while copying; release it on exit."""

    def release(self, hold: str) -> None:
        """Release ``hold`` without reading."""

    def attach(self, descriptor: Any) -> torch.Tensor:
        """A flat ``uint8`` tensor over the producer's region (regions this process maps)."""

    def copy_all(self, descriptor: Any, copies: Sequence[PageCopy], wait: bool = False) -> int:
        """Copy every part (producer page ``s`` into local page ``d`` for each pair) as
        one move; bytes copied. ``wait``: return once the pages are written."""


class SharedPagesPlan:
    """Copy tokens ``[first_block * block_size, num_tokens)`` of a shared-pages payload.

    ``layer_ids``/``layer_first``: each local layer's own table and first block to write
    (a model with several KV cache groups); the payload's groups
    (:mod:`~vllm_omni_kv.kvcache.page_groups`) say which producer blocks each holds.
    ``states``: the local state layers of a hybrid model, whose pages the payload names
    too (:mod:`~vllm_omni_kv.kvcache.shared_states`); they are copied under the same hold."""

    def __init__(
        self,
        payload: dict[str, Any],
        source: PageSource | None,
        caches: Sequence[torch.Tensor],
        ident: KVLayoutId,
        block_ids: Sequence[int],
        first_block: int,
        verify: bool,
        layer_ids: Sequence[Sequence[int]] | None = None,
        layer_first: Sequence[int] | None = None,
        states: Sequence[StatePage] = (),
    ) -> None:
        if source is None:
            raise KVPayloadError(
                "received a shared-pages payload but this engine's backend exports no cache "
                "region: configure both stages with the same backend"
            )
        meta, self.shared, _ids, groups = shared_groups(payload)
        if meta.kv_layout != ident:
            raise KVPayloadError(
                f"shared pages of {meta.kv_layout.describe() if meta.kv_layout else '?'} cannot "
                f"be copied into {ident.describe()}: serve both stages with the same KV layout"
            )
        if meta.num_layers != len(caches):
            raise KVPayloadError(f"payload has {meta.num_layers} layers, this engine {len(caches)}")
        n = meta.num_blocks
        if len(block_ids) < n and layer_ids is None:
            raise KVPayloadError(f"payload spans {n} blocks, the request has {len(block_ids)}")
        if not 0 <= first_block <= n:
            raise KVPayloadError(f"first block {first_block} is outside the payload's {n} blocks")
        self.source, self.caches, self.ident = source, caches, ident
        self.copies = group_copies(groups, block_ids, first_block, n, layer_ids, layer_first)
        self.states = SharedStates(self.shared, payload["metadata"], states, meta.num_layers)
        self.whole = len(self.copies) == 1 and self.copies[0].layers == list(range(len(caches)))
        self.verify = verify
        self.tokens = max(0, meta.num_tokens - first_block * meta.block_size)
        self.moved = 0  # bytes copied (the frame itself moves none of them)

    def _pick(self, layers: list[int]) -> Callable[[list[Any]], list[Any]]:
        """The rows of ``layers`` of a per-layer list (all of it for a single group)."""
        return (lambda rows: rows) if self.whole else (lambda rows: [rows[i] for i in layers])

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every ``(producer page, local page)`` copied, over all groups."""
        return [p for c in self.copies for p in c.pairs]

    def spans(self, frame_address: int | None) -> list[Span] | None:
        return []  # the frame carries no KV bytes

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        copies = [c for c in self.copies if c.pairs]
        if not copies and not self.states.calls:
            self.source.release(str(self.shared.get("hold")))
            return self.tokens
        geometry: list[Any] = self.shared["geometry"]  # checked: one entry per layer
        sums: list[list[int]] | None = self.shared.get("sums") if self.verify else None
        parts = [
            PageCopy(
                pick(geometry),
                self.ident,
                pick(list(self.caches)),
                c.pairs,
                None if sums is None else pick(sums),
                c.first,
            )
            for c, pick in ((c, self._pick(c.layers)) for c in copies)
        ]
        parts += self.states.copies(self.verify)
        with self.source.reading(self.shared.get("hold")):  # the blocks are read (one
            region = self.shared.get("region")  # host wait) before the hold goes back
            self.moved += self.source.copy_all(region, parts, wait=True)
        return self.tokens


#: torch dtypes of the identity's dtype names that are not torch attribute names
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def materialize_pages(payload: dict[str, Any], source: PageSource | None) -> dict[str, Any]:
    """The paged-blocks payload of a shared-pages one: the request's pages copied out of
    the producer's cache under the payload's hold (one copy), for a reader without a
    paged cache of its own (the manager API)."""
    if source is None:
        raise KVPayloadError(
            "received a shared-pages payload but this backend maps no producer's cache "
            "region: use the same backend settings on both stages"
        )
    meta, shared, _ids, groups = shared_groups(payload)
    ident = meta.kv_layout
    dtype = _FP8.get(ident.dtype) if ident is not None else None
    dtype = dtype or (getattr(torch, ident.dtype, None) if ident is not None else None)
    if ident is None or not isinstance(dtype, torch.dtype):
        raise KVPayloadError(f"shared-pages payload of an unknown KV dtype: {meta.kv_layout}")
    of_layer = {i: g for g in groups for i in g.layers}
    with source.reading(shared.get("hold")):
        base = source.attach(shared.get("region"))
        views = attach_layers(base, shared.get("geometry"), ident, dtype)
        # each group's block ids once, where the producer's pages are (a device for cuda_ipc)
        ids = {
            id(g): torch.tensor(g.block_ids, dtype=torch.long, device=base.device) for g in groups
        }
        try:
            pages = [
                page_view(v, ident).index_select(0, ids[id(of_layer[i])])
                for i, v in enumerate(views)
            ]
        except (IndexError, RuntimeError) as e:
            raise KVPayloadError(f"shared-pages payload names pages outside its cache: {e}") from e
        streams = streams_of(base.device)
        if streams is not None:  # the gathers have read the pages before the hold goes back
            settle(streams, base.device)
    md = {k: v for k, v in payload["metadata"].items() if k != SHARED}
    md["format"] = PAGED_BLOCKS
    if SHARED_GROUPS in shared:  # each layer holds its group's blocks
        md[LAYER_FIRST_BLOCKS] = [of_layer[i].first for i in range(len(views))]
    return {
        "request_id": payload.get("request_id"),
        "layer_blocks": {KV_BLOCKS: pages},
        "block_ids": list(range(meta.num_blocks)),
        "metadata": md,
    }
