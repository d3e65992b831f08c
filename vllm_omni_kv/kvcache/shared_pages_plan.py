"""The injection plan of a shared-pages payload: copy pages out of the producer's cache.

The third plan beside paged blocks and token-major K/V. Its bytes do not travel in
the frame: a :class:`PageSource` (a backend's cache region) copies the request's
pages straight from the producer's exported cache into the local one while the
payload's hold is taken.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.meta import PAGED_BLOCKS
from vllm_omni_kv.kvcache.paged_blocks import KV_BLOCKS
from vllm_omni_kv.kvcache.shared_pages import SHARED, attach_layers, shared_fields
from vllm_omni_kv.wire.stream import PayloadStream, Span


class PageSource(Protocol):
    """Where a consumer copies a producer's pages from (a backend's cache region)."""

    def reading(self, hold: Any) -> AbstractContextManager[Any]:
        """Hold ``hold`` while copying; release it on exit."""

    def release(self, hold: str) -> None:
        """Release ``hold`` without reading."""

    def attach(self, descriptor: Any) -> torch.Tensor:
        """A flat ``uint8`` tensor over the producer's region (regions this process maps)."""

    def copy_into(
        self,
        descriptor: Any,
        geometry: Any,
        ident: KVLayoutId,
        caches: Sequence[torch.Tensor],
        pairs: Sequence[tuple[int, int]],
        sums: list[list[int]] | None,
        first: int,
    ) -> int:
        """Copy producer page ``s`` into local page ``d`` for each pair; bytes copied."""


class SharedPagesPlan:
    """Copy tokens ``[first_block * block_size, num_tokens)`` of a shared-pages payload."""

    def __init__(
        self,
        payload: dict[str, Any],
        source: PageSource | None,
        caches: Sequence[torch.Tensor],
        ident: KVLayoutId,
        block_ids: Sequence[int],
        first_block: int,
        verify: bool,
    ) -> None:
        if source is None:
            raise KVPayloadError(
                "received a shared-pages payload but this engine's backend exports no cache "
                "region: configure both stages with the same backend"
            )
        meta, self.shared, src_ids = shared_fields(payload)
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
        self.source, self.caches, self.ident = source, caches, ident
        self.pairs = list(zip(src_ids[first_block:n], block_ids[first_block:n], strict=True))
        self.first = first_block
        self.verify = verify
        self.tokens = max(0, meta.num_tokens - first_block * meta.block_size)
        self.moved = 0  # bytes copied (the frame itself moves none of them)

    def spans(self, frame_address: int | None) -> list[Span] | None:
        return []  # the frame carries no KV bytes

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        if not self.pairs:
            self.source.release(str(self.shared.get("hold")))
            return self.tokens
        with self.source.reading(self.shared.get("hold")):
            self.moved = self.source.copy_into(
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
    meta, shared, ids = shared_fields(payload)
    ident = meta.kv_layout
    dtype = _FP8.get(ident.dtype) if ident is not None else None
    dtype = dtype or (getattr(torch, ident.dtype, None) if ident is not None else None)
    if ident is None or not isinstance(dtype, torch.dtype):
        raise KVPayloadError(f"shared-pages payload of an unknown KV dtype: {meta.kv_layout}")
    with source.reading(shared.get("hold")):
        base = source.attach(shared.get("region"))
        views = attach_layers(base, shared.get("geometry"), ident, dtype)
        index = torch.tensor(ids, dtype=torch.long)
        try:
            pages = [page_view(v, ident).index_select(0, index) for v in views]
        except (IndexError, RuntimeError) as e:
            raise KVPayloadError(f"shared-pages payload names pages outside its cache: {e}") from e
    md = {k: v for k, v in payload["metadata"].items() if k != SHARED}
    md["format"] = PAGED_BLOCKS
    return {
        "request_id": payload.get("request_id"),
        "layer_blocks": {KV_BLOCKS: pages},
        "block_ids": list(range(len(ids))),
        "metadata": md,
    }
