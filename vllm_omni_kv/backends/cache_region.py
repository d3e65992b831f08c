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

Placement is verified, not assumed: :meth:`CacheRegion.check_placement` raises
``ConfigError`` unless every layer view vLLM registered lies inside the memory allocated
through :meth:`CacheRegion.allocation_context`, so that the connector fails engine start
when vLLM's allocator is one the context does not reach, rather than silently sending
packed payloads. A region
that cannot be reserved (a full ``/dev/shm``) leaves the allocation to vLLM and says why
in :attr:`CacheRegion.unavailable_reason`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.device_order import settle, streams_of
from vllm_omni_kv.kvcache.move_plan import MovePlan, Part
from vllm_omni_kv.kvcache.movers import move
from vllm_omni_kv.kvcache.page_view_cache import PageViewCache
from vllm_omni_kv.kvcache.shared_pages import PageCopy, attach_layers, same_geometry
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)


class AllocateHostCache(TorchFunctionMode):
    """Inside it, the first large host ``torch.zeros(n, dtype=torch.int8)`` (how vLLM's
    ``allocate_kv_cache`` allocates the whole KV cache) returns ``allocate(n)`` instead,
    or runs unchanged where ``allocate`` returns None (the region cannot be reserved);
    every other call runs unchanged. ``entered``: whether vLLM entered it."""

    def __init__(
        self, allocate: Callable[[int], torch.Tensor | None], min_bytes: int = 1 << 20
    ) -> None:
        super().__init__()
        self.allocate = allocate
        self.min_bytes = min_bytes
        self.done = False
        self.entered = False

    def __enter__(self) -> AllocateHostCache:
        self.entered = True
        super().__enter__()
        return self

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
            got = self.allocate(int(args[0]))
            if got is not None:
                return got
        return func(*args, **kwargs)


def view_extent(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` byte addresses the view ``t`` can touch, for any strides
    (negative ones included); None for an empty view, which touches nothing."""
    if t.numel() == 0:
        return None
    low = high = 0
    for size, stride in zip(t.shape, t.stride(), strict=True):
        step = (size - 1) * stride
        if step < 0:
            low += step
        else:
            high += step
    esize, ptr = t.element_size(), t.data_ptr()
    return ptr + low * esize, ptr + (high + 1) * esize


def check_generation(descriptor: Any, current: int) -> None:
    """Refuse a payload whose region ``descriptor`` names another generation than the
    producer's ``current`` one (it slept since: its pages may be gone or reused), before
    any byte is read: ``KVTransferError`` (the request is recomputed)."""
    got = descriptor.get("generation", 0) if isinstance(descriptor, dict) else None
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise KVPayloadError(f"cache region descriptor names no generation: {got!r}")
    if got != current:
        now = "asleep" if current % 2 else f"registered again as generation {current}"
        raise KVTransferError(
            f"this payload names the producer's KV cache of generation {got}, which vLLM's "
            f"sleep mode has since discarded (the cache is {now}): the request is recomputed"
        )


class CacheRegion(ABC):
    """The producer's exportable KV cache and the holds on its blocks (one per process)."""

    #: the region's kind, named in payloads (``shm``, ``cuda_ipc``)
    kind: str = ""
    #: consumer: the page views of the last producer region copied from, per geometry
    #: (see copy_into)
    _views: dict[Any, tuple[torch.Tensor, list[tuple[Any, list[torch.Tensor]]]]]
    #: consumer: the page views of its own layer tensors it copies into
    _local_pages: PageViewCache
    #: whether the producer adds a digest per page, which consumers verify after copying
    #: (the backend setting ``verify_pages``, host caches only: a GPU cache would need a
    #: device-to-host copy to hash). Off by default: the hold already keeps the pages
    #: unchanged while they are copied; digests catch bugs, at about a memcpy's cost more.
    digests: bool = False
    #: producer: the device type of the KV caches this region places (``cpu``: host caches)
    places: str = "cpu"
    #: producer: the flat allocation made through allocation_context, once made
    tensor: torch.Tensor | None = None
    #: producer: why the region could not be reserved (vLLM then allocated the KV cache
    #: as usual: send packed payloads); None when it was, or was never asked to be
    unavailable_reason: str | None = None
    #: producer: the setting that turns this one-copy mode off (named in placement errors)
    off_switch: str = "turn off the backend's one-copy mode"
    #: the cache's registration generation, named in every region descriptor: even while
    #: exported, odd while asleep (vLLM's sleep and wake-up each add one)
    generation: int = 0

    # -- producer ------------------------------------------------------------------------
    @abstractmethod
    def allocation_context(self) -> AbstractContextManager[Any] | None:
        """The context vLLM allocates the KV cache in (``get_mem_pool_context``)."""

    def allocations(self) -> list[tuple[int, int]]:
        """``(base address, bytes)`` of the memory allocated through
        :meth:`allocation_context` (the default: :attr:`tensor`)."""
        t = self.tensor
        return [] if t is None else [(t.data_ptr(), t.numel() * t.element_size())]

    def context_entered(self) -> bool | None:
        """Whether vLLM entered :meth:`allocation_context`; None where not tracked."""
        return None

    def describe(self) -> str:
        """The region, as placement errors name it."""
        return f"the {self.kind} cache region"

    def check_placement(self, caches: Sequence[torch.Tensor]) -> None:
        """Verify that every byte of every layer view in ``caches`` (vLLM's registered KV
        caches) lies inside one allocation made through :meth:`allocation_context`.
        ``ConfigError`` naming the first layer outside it, or saying that nothing was
        allocated there (or that the region was unavailable)."""
        if self.unavailable_reason is not None:
            raise ConfigError(
                f"{self.describe()} holds no KV cache: {self.unavailable_reason}; "
                f"{self.off_switch}, or make room for it"
            )
        spans = self.allocations()
        if not spans:
            raise ConfigError(self._missed())
        for i, c in enumerate(caches):
            if c.device.type != self.places:
                where = f"is on {c.device}, where this region places no cache"
            else:
                ext = view_extent(c)
                if ext is None or any(b <= ext[0] and ext[1] <= b + n for b, n in spans):
                    continue
                where = f"spans {ext[0]:#x}..{ext[1]:#x}"
            raise ConfigError(
                f"vLLM allocated the KV cache outside {self.describe()} ("
                + ", ".join(f"{b:#x}+{n} bytes" for b, n in spans)
                + f"): layer {i} {where}. This vLLM version's KV cache allocator is not "
                f"supported by this one-copy mode: {self.off_switch}"
            )

    def _missed(self) -> str:
        entered = self.context_entered()
        if entered is False:
            how = "vLLM never entered the connector's get_mem_pool_context()"
        elif entered:
            takes = (
                "one host torch.zeros(n, dtype=torch.int8) of at least 1 MiB"
                if self.places == "cpu"
                else "what this thread allocates while inside it"
            )
            how = (
                "vLLM entered the connector's get_mem_pool_context() but allocated nothing "
                f"through it (the region takes {takes})"
            )
        else:
            how = "nothing was allocated through the connector's get_mem_pool_context()"
        return (
            f"vLLM allocated the KV cache outside {self.describe()}: {how}. This vLLM "
            f"version's KV cache allocator is not supported by this one-copy mode: "
            f"{self.off_switch}"
        )

    @abstractmethod
    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        """``(region descriptor, base address, bytes)`` of the allocation holding vLLM's
        layer views ``caches``; None when they were not allocated in this region."""

    def ready(self, caches: Sequence[torch.Tensor]) -> None:
        """Called before payloads naming pages of ``caches`` are published (once per
        step): return once those pages are final. A device cache: an event recorded on
        the forward stream is waited for (another process reads the pages with no
        ordering on this device); host memory is written synchronously, final already."""
        device = caches[0].device if caches else None
        streams = streams_of(device)
        if device is not None and streams is not None:
            settle(streams, device)

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

    @abstractmethod
    def expire_hold(self, hold: str) -> bool:
        """Take ``hold`` back although a consumer may still be reading under it (it held
        the blocks past the lease and its grace): that consumer's copy must fail when it
        ends. True when it is gone; False keeps the blocks from vLLM."""

    @abstractmethod
    def revoke(self, hold: str) -> None:
        """The blocks under ``hold`` were freed (vLLM preempted the request): a consumer
        copying under it must fail when its copy ends."""

    # -- sleep mode (vLLM's unregister_kv_caches / restore_kv_caches) -------------------
    @property
    def asleep(self) -> bool:
        """Between :meth:`sleep` and :meth:`wake` (the generation is odd then)."""
        return self.generation % 2 == 1

    def sleep(self) -> None:
        """vLLM's sleep: the KV cache's memory may be discarded. The generation moves on,
        so consumers refuse every payload exported before; a producer drops its
        registrations, a consumer its mappings of producers' regions (no copy may run).
        The caller voids the holds first. Idempotent."""
        if not self.asleep:
            self.generation += 1
            self._views = {}
            if getattr(self, "_local_pages", None) is not None:
                self._local_pages.clear()
            self._withdraw()

    def wake(self) -> None:
        """After vLLM's wake-up: the next generation, which payloads exported from now on
        carry (the caller exports the cache again). Idempotent."""
        if self.asleep:
            self.generation += 1
            self._restore()

    def _withdraw(self) -> None:
        """Drop what points at the cache (see :meth:`sleep`); the default keeps nothing
        else that points at it."""
        logger.debug("%s: asleep (generation %d)", self.describe(), self.generation)

    def _restore(self) -> None:
        """Publish the new generation, register again (see :meth:`wake`)."""
        logger.debug("%s: awake (generation %d)", self.describe(), self.generation)

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
        verify (``pairs[j]`` is payload page ``first + j``). Called under the hold: one
        :meth:`copy_all` of one part."""
        return self.copy_all(descriptor, [PageCopy(geometry, ident, caches, pairs, sums, first)])

    def copy_all(self, descriptor: Any, copies: Sequence[PageCopy], wait: bool = False) -> int:
        """Every part of one move under the hold (a load's page groups and state pages):
        the region mapped (and its producer's liveness checked) once, one
        :class:`~vllm_omni_kv.kvcache.move_plan.MovePlan` over all of them, one mover
        call (:mod:`~vllm_omni_kv.kvcache.movers`); bytes copied. ``wait``: return once
        the pages are written (a device move: one host wait). The default maps the
        region with :meth:`attach`."""
        try:
            base = self.attach(descriptor)  # checks the producer is alive, once per move
        except BaseException:
            self._views = {}  # a dead producer's mapping must not stay pinned by our views
            raise
        local = getattr(self, "_local_pages", None)
        if local is None:
            local = self._local_pages = PageViewCache()
        parts: list[Part] = [
            (self._producer_pages(base, c), local.pages(c.caches, c.ident),
             c.pairs, c.sums, c.first)
            for c in copies
        ]  # fmt: skip
        return move(MovePlan.stacked(parts), wait)

    def _producer_pages(self, base: torch.Tensor, c: PageCopy) -> list[torch.Tensor]:
        """The producer's page views of ``c`` over the mapped ``base``, kept per geometry
        (compared by value) while that mapping lasts: at most 8 sets (one per layer
        group), all over ``base``."""
        key = (id(base), c.ident, c.caches[0].dtype)
        views = getattr(self, "_views", {})
        hit = views.get(key)
        if hit is not None and hit[0] is base:
            for geometry, pages in hit[1]:
                if same_geometry(geometry, c.geometry):
                    return pages
        src = attach_layers(base, c.geometry, c.ident, c.caches[0].dtype)  # checks it
        pages = [page_view(v, c.ident) for v in src]
        own = [[g[0], list(g[1]), list(g[2])] for g in c.geometry]  # a copy: ours alone
        sets = hit[1][-7:] if hit is not None and hit[0] is base else []
        kept = {k: v for k, v in views.items() if v[0] is base and k != key}
        self._views = {**kept, key: (base, [*sets, (own, pages)])}
        return pages

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
