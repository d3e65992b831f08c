"""Pick the injection plan for a received payload by its format (one entry point for clients)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.kv_utils import LayerKV
from vllm_omni_kv.kvcache.meta import PAGED_BLOCKS, PayloadMeta
from vllm_omni_kv.kvcache.paged_blocks import LayoutArg, plan_block_injection
from vllm_omni_kv.kvcache.shared_pages import is_shared_payload
from vllm_omni_kv.kvcache.shared_pages_plan import PageSource, SharedPagesPlan
from vllm_omni_kv.kvcache.shared_states import StatePage
from vllm_omni_kv.kvcache.token_major import plan_token_injection
from vllm_omni_kv.wire.stream import PayloadStream, Span


class InjectionPlan(Protocol):
    """Where a payload's bytes go in a local paged cache."""

    tokens: int

    def spans(self, frame_address: int | None) -> list[Span] | None: ...

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int: ...


def plan_injection(
    data: dict[str, Any],
    kv_caches: Sequence[LayerKV | None],
    block_ids: Sequence[int],
    *,
    start_token: int = 0,
    layout: LayoutArg = None,
    pages: PageSource | None = None,
    verify: bool = True,
    layer_ids: Sequence[Sequence[int]] | None = None,
    layer_first: Sequence[int] | None = None,
    states: Sequence[StatePage] = (),
) -> InjectionPlan:
    """The plan that writes tokens ``[start_token, num_tokens)`` of ``data`` into ``block_ids``.

    ``kv_caches`` are the local layers ``data`` covers (for a layer-wise part, its
    slice); ``start_token`` is a multiple of the block size (a local prefix hit).
    ``layout``: the local caches' layout identity (paged blocks), or a layout name
    (token-major: see ``normalize_layer_kv``). ``pages``: where a shared-pages payload's
    pages are copied from (the backend's cache region); ``verify``: check their digests.
    ``layer_ids``/``layer_first``: each local layer's own table and first block to write
    (a shared-pages payload into a cache of several KV cache groups); ``states``: the
    local state layers a shared-pages payload of a hybrid model names pages of.
    """
    if is_shared_payload(data):
        if not isinstance(layout, KVLayoutId):
            raise KVPayloadError("a shared-pages payload needs a paged cache's layout identity")
        first = start_token // max(1, layout.block_size)
        caches: list[Any] = list(kv_caches)
        return SharedPagesPlan(
            data, pages, caches, layout, block_ids, first, verify, layer_ids, layer_first, states
        )
    meta = PayloadMeta.of(data)
    if meta.format == PAGED_BLOCKS:
        if start_token % meta.block_size:
            raise KVPayloadError(
                f"start token {start_token} is not at a block boundary ({meta.block_size})"
            )
        caches = list(kv_caches)
        return plan_block_injection(
            data, caches, block_ids, first_block=start_token // meta.block_size, layout=layout
        )
    name = layout if isinstance(layout, str) else None
    return plan_token_injection(data, kv_caches, block_ids, start_token=start_token, layout=name)
