"""A paged KV cache that other processes on this host can copy pages out of.

A backend with a cache region places the producer's KV cache in exportable memory
(vLLM calls the connector's ``get_mem_pool_context()`` around the allocation), and
publishes per request only a small shared-pages payload naming the region and the
blocks (:mod:`vllm_omni_kv.kvcache.shared_pages`). The consumer copies the pages
straight out of the producer's cache into its own.

The producer must not reuse those blocks while a consumer reads them. Every such
payload comes with a *hold*: the producer keeps the request's blocks until the hold is
released. The consumer takes the hold for the duration of its copy and releases it
when done (or when it gives up); the producer takes back a hold that nobody is reading
once the payload's lease has run out. A consumer that finds its hold already taken back
gets a clean error and recomputes; it never reads blocks that may have been reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.shared_pages import attach_layers, copy_pages


class AllocateHostCache(TorchFunctionMode):
    """Inside it, the first large host ``torch.zeros(n, dtype=torch.int8)`` (how vLLM's
    ``allocate_kv_cache`` allocates the whole KV cache) returns ``allocate(n)`` instead;
    every other call runs unchanged."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], min_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.allocate = allocate
        self.min_bytes = min_bytes
        self.done = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and not self.done
            and len(args) == 1
            and isinstance(args[0], int)
            and args[0] >= self.min_bytes
            and kwargs.get("dtype") is torch.int8
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        ):
            self.done = True
            return self.allocate(int(args[0]))
        return func(*args, **kwargs)


class CacheRegion(ABC):
    """The producer's exportable KV cache and the holds on its blocks (one per process)."""

    #: the region's kind, named in payloads (``shm``, ``cuda_ipc``)
    kind: str = ""
    #: consumer: the page views of the last producer region copied from (see copy_into)
    _views: dict[Any, tuple[torch.Tensor, list[torch.Tensor]]]
    #: whether the producer adds a digest per page, which consumers verify after copying
    #: (the backend setting ``verify_pages``, host caches only: a GPU cache would need a
    #: device-to-host copy to hash). Off by default: the hold already keeps the pages
    #: unchanged while they are copied; digests catch bugs, at about a memcpy's cost more.
    digests: bool = False

    # -- producer ------------------------------------------------------------------------
    @abstractmethod
    def allocation_context(self) -> AbstractContextManager[Any] | None:
        """The context vLLM allocates the KV cache in (``get_mem_pool_context``)."""

    @abstractmethod
    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        """``(region descriptor, base address, bytes)`` of the allocation holding vLLM's
        layer views ``caches``; None when they were not allocated in this region."""

    def ready(self, caches: Sequence[torch.Tensor]) -> None:
        """Called before a payload naming pages of ``caches`` is published: return once
        those pages are final (a device cache: the forward that wrote them has run)."""
        del caches  # host memory: written synchronously, final already

    @abstractmethod
    def hold(self, from_stage: str, to_stage: str, key: str) -> str:
        """Create the hold for the payload about to be published under ``key``."""

    @abstractmethod
    def released(self, hold: str) -> bool:
        """Whether a consumer has released ``hold`` (its copy is done, or it gave up)."""

    @abstractmethod
    def take_back(self, hold: str) -> bool:
        """Remove ``hold`` unless a consumer is reading under it right now; True when it is
        gone (taken back, or released)."""

    # -- consumer ------------------------------------------------------------------------
    def attach(self, descriptor: Any) -> torch.Tensor:
        """A flat ``uint8`` tensor over the producer's region (regions this process can
        map); ``KVTransferError`` when the producer is gone, ``KVPayloadError`` for a
        descriptor this region cannot map."""
        raise KVPayloadError(f"a {self.kind} cache region cannot be mapped in this process")

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
        """Copy producer page ``s`` into page ``d`` of the local layer views ``caches`` for
        each ``(s, d)`` in ``pairs``; return bytes copied. ``geometry``: where the
        producer's layer views lie in its region; ``sums``: per-layer page digests to
        verify (``pairs[j]`` is payload page ``first + j``). Called under the hold. The
        default maps the region (:meth:`attach`) and copies locally."""
        try:
            base = self.attach(descriptor)  # checks the producer is alive, every time
        except BaseException:
            self._views = {}  # a dead producer's mapping must not stay pinned by our views
            raise
        key = (id(base), repr(geometry), ident, caches[0].dtype)
        hit = getattr(self, "_views", {}).get(key)
        if hit is None or hit[0] is not base:
            src = attach_layers(base, geometry, ident, caches[0].dtype)
            hit = (base, [page_view(v, ident) for v in src])
            self._views = {key: hit}  # one producer's views: they stay valid while mapped
        return copy_pages(hit[1], [page_view(c, ident) for c in caches], pairs, sums, first)

    @abstractmethod
    def reading(self, hold: Any) -> AbstractContextManager[Any]:
        """Hold ``hold`` while copying; releases it on exit (success or not).
        ``KVTransferError`` on entry when the producer already took it back."""

    @abstractmethod
    def hold_name(self, from_stage: str, to_stage: str, key: str) -> str:
        """The hold of the payload under ``key`` (what :meth:`hold` returns for it)."""

    @abstractmethod
    def release(self, hold: str) -> None:
        """Release ``hold`` without reading (a payload discarded unread); idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Producer: take back every hold, unmap the region. Consumer: drop mappings."""
