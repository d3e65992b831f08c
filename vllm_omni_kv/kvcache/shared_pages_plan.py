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
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.shared_pages import shared_fields
from vllm_omni_kv.wire.stream import PayloadStream, Span


class PageSource(Protocol):
    """Where a consumer copies a producer's pages from (a backend's cache region)."""

    def reading(self, hold: Any) -> AbstractContextManager[Any]:
        """Hold ``hold`` while copying; release it on exit."""

    def release(self, hold: str) -> None:
        """Release ``hold`` without reading."""

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
