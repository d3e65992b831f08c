"""The producer's KV cache registered with a pull connector's engine (``register_cache``).

One implementation for every engine behind the pull connector's
:class:`~vllm_omni_kv.backends.pull.pull_stream.EngineAdapter` (Mooncake
Transfer Engine, NIXL): it registers memory with the engine and pulls with the
connector's bounded (batched) engine reads, nothing engine-specific.

Producer: inside :meth:`TECacheRegion.allocation_context` vLLM's one host allocation of
the KV cache becomes a page-aligned anonymous mapping registered with the connector's
engine. A payload is then a small shared-pages frame (block ids, layer geometry, page
digests) put in the pool as usual; consumers pull the pages they lack straight out of
the registered cache with engine reads: no staging copy on the producer.

A CUDA cache (vLLM allocates it in one ``torch.zeros`` on the device, which the
allocation context leaves alone) is registered where it is exported, as device memory
(:meth:`TECacheRegion.export`; NIXL: ``VRAM`` of its device, Mooncake: a CUDA build's
``register_memory`` of the device pointer), and pages move device to device; the
producer synchronizes its stream before publishing a payload. An engine that cannot
register device memory (Mooncake's non-CUDA build), a failed registration or
expandable segments leave the cache unregistered: packed payloads, logged at start.
**The CUDA path has not run on a GPU** in this project (no GPU in its CI); its test
(``test_register_cache_cuda_pages_move_device_to_device`` in
``tests/backends/test_conformance.py``) is in ``make gpu-check`` and skips there
unless the engine's package is installed.

Holds are the pull protocol's exposure of that small frame (its edge key): the
consumer's stream on the frame holds a lease for the whole copy (``SharedPagesPlan.apply``
runs inside the open stream, see ``transfer.session.receive_into``), and the copy
ends that lease itself: the release's reply confirms the exposure stayed live for all
of the copy. The producer frees the blocks once the exposure is gone (released after
the copy, or discarded), and takes a hold back (withdraws the exposure) only when no
lease on it is live; an expired lease of a dead consumer does not count, and its late
release is refused, so that consumer's copy fails and the request is recomputed.

Consumer: the pages are pulled run by run (pages consecutive on both sides, per layer)
straight into the consumer's own cache when that cache is registered too (allocated
in its region); otherwise through a block of its registered pool, then copied. Every
remote range is checked against the producer's registered region first; every read
is bounded by ``transfer_timeout_s``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from vllm_omni_kv.backends.cache_region import AllocateHostCache, CacheRegion, check_generation
from vllm_omni_kv.backends.keys import edge_key
from vllm_omni_kv.backends.pull.page_pull import PagePull
from vllm_omni_kv.backends.pull.pull import PullTransferConnector
from vllm_omni_kv.backends.pull.pull_stream import is_session
from vllm_omni_kv.backends.pull.puller import register_memory
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.move_plan import MovePlan, Part
from vllm_omni_kv.kvcache.shared_pages import PageCopy, attach_layers, layer_geometry
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: producers whose newest generation a consumer remembers (least recently seen forgotten
#: first; as many as NIXL keeps peers loaded)
MAX_SEEN = 256


class TECacheRegion(CacheRegion):
    """A KV cache registered with the connector's engine (both roles); its ``kind`` (named
    in payloads) is the connector's backend name: ``mooncake_te`` or ``nixl``."""

    off_switch = "set backend_extra.register_cache: false (packed payloads)"

    def __init__(self, conn: PullTransferConnector) -> None:
        self.conn = conn
        self.kind = conn.backend_name
        self.tensor: torch.Tensor | None = None  # flat bytes of the registered cache
        self._map: mmap.mmap | None = None
        self._registered: int | None = None  # base address of ``tensor`` while registered
        #: everything registered here: address -> (bytes, device); unregistered at close
        self._spans: dict[int, tuple[int, torch.device]] = {}
        #: consumer: the newest generation of each producer, least recently seen first
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._holds: set[str] = set()  # producer: holds made and not yet known gone
        self._lock = threading.Lock()

    # -- producer (and consumer: its own cache is registered too) ------------------------
    def allocation_context(self) -> AllocateHostCache:
        return AllocateHostCache(self.allocate)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed, page-aligned ``int8`` host tensor of ``nbytes``, registered with the
        connector's engine."""
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # through a memoryview: torch keeps it, and with it a buffer export of the map, so
        # the map cannot be closed under the tensor (torch keeps no export of ``mm`` itself)
        tensor = torch.frombuffer(memoryview(mm), dtype=torch.int8, count=nbytes)
        addr = tensor.data_ptr()
        register_memory(self.conn.engine, self.kind, addr, nbytes, tensor.device)
        with self._lock:
            self._map, self.tensor, self._registered = mm, tensor, addr
            self._spans[addr] = (nbytes, tensor.device)
        self._registered_log(nbytes, "host")
        return tensor

    def _registered_log(self, nbytes: int, where: str) -> None:
        logger.info(
            "KV cache (%.1f MiB, %s) registered with the %s engine at %s: consumers pull its "
            "pages directly",
            nbytes / 2**20,
            where,
            self.conn.backend_name,
            self.conn.engine.session,
        )

    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        if not caches:
            return None
        if caches[0].device.type == "cuda" and not self._register_device_cache(caches):
            return None
        t = self.tensor
        if t is None or t.device != caches[0].device or self._registered is None:
            return None
        base, nbytes = t.data_ptr(), int(t.numel())
        if layer_geometry(caches, base, nbytes) is None:
            return None
        desc = {
            "kind": self.kind,
            "session": self.conn.engine.session,
            "base": base,
            "size": nbytes,
            "generation": self.generation,
        }
        return desc, base, nbytes

    def _register_device_cache(self, caches: Sequence[torch.Tensor]) -> bool:
        """Register the CUDA allocation holding ``caches`` (vLLM's one ``torch.zeros``) as
        device memory; False, with a warning, where it cannot be (packed payloads).
        Written for GPUs, **not run on one yet** (no GPU in this project's CI)."""
        storage = caches[0].untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        if self._registered == base:
            return True  # exported before
        why = ""
        if self.tensor is not None and self.tensor.device.type != "cpu":
            why = "another device cache is registered already"
        elif any(c.untyped_storage().data_ptr() != base for c in caches):
            why = "its layers are not one allocation"
        elif "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
            why = "PYTORCH_CUDA_ALLOC_CONF has expandable_segments (not registrable memory)"
        else:
            try:
                register_memory(self.conn.engine, self.kind, base, nbytes, caches[0].device)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
        if why:
            logger.warning(
                "%s register_cache: the KV cache on %s is not registered (%s): packed payloads",
                self.conn.backend_name,
                caches[0].device,
                why,
            )
            return False
        view = torch.empty(0, dtype=torch.uint8, device=caches[0].device)
        view.set_(storage, 0, (nbytes,), (1,))
        with self._lock:
            self.tensor, self._registered = view, base
            self._spans[base] = (nbytes, caches[0].device)
        if self.conn._puller.device is None:  # reads land in this device's memory
            self.conn._puller.device = caches[0].device
        if self.digests:
            logger.warning("verify_pages is for host caches: off for the KV cache on a GPU")
            self.digests = False  # hashing device pages would need a copy to the host
        self._registered_log(nbytes, str(caches[0].device))
        return True

    # -- sleep mode ----------------------------------------------------------------------
    def _withdraw(self) -> None:
        """Unregister the cache from the engine (kept listed, for :meth:`wake`) and revoke
        every hold's exposure: a pull running from it fails, or its release does."""
        with self._lock:
            spans, self._registered = list(self._spans), None
            holds, self._holds = list(self._holds), set()
        for hold in holds:  # a pull under a lease taken before the sleep fails at its end
            self.conn._exposed.revoke(hold)
        for addr in spans:
            self._unregister(addr)

    def _restore(self) -> None:
        """Register the cache again; ``KVTransferError`` when the engine refuses (the
        caller sends packed payloads then)."""
        with self._lock:
            spans = dict(self._spans)
        for addr, (size, device) in spans.items():
            register_memory(self.conn.engine, self.kind, addr, size, device)
        with self._lock:
            self._registered = None if self.tensor is None else self.tensor.data_ptr()

    def _unregister(self, addr: int) -> None:
        try:
            self.conn.engine.unregister(addr)
        except Exception as e:
            logger.debug("unregistering the KV cache: %s", e)

    def hold(self, from_stage: str, to_stage: str, key: str) -> str:
        name = self.hold_name(from_stage, to_stage, key)
        if self.conn._exposed.exposed(name):
            raise KVTransferError(
                f"a payload under key {key!r} on {from_stage}->{to_stage} is still held: use "
                "a unique key per transfer"
            )
        with self._lock:
            self._holds.add(name)
        return name

    def released(self, hold: str) -> bool:
        return self._gone(hold, not self.conn._exposed.exposed(hold))

    def take_back(self, hold: str) -> bool:
        return self._gone(hold, self.conn._exposed.withdraw(hold))

    def _gone(self, hold: str, gone: bool) -> bool:
        if gone:
            with self._lock:
                self._holds.discard(hold)
        return gone

    def revoke(self, hold: str) -> None:
        """vLLM freed the blocks under ``hold`` (a preemption): stop exposing it even under
        a live lease, so that a pull copying them fails at its release."""
        self.conn._exposed.revoke(hold)
        self._gone(hold, True)

    def expire_hold(self, hold: str) -> bool:
        # the reader held the blocks past its lease and the grace: they go back to vLLM
        # now, so its lease goes too (its release fails the copy instead of passing it)
        self.revoke(hold)
        return True

    def hold_name(self, from_stage: str, to_stage: str, key: str) -> str:
        return edge_key(key, from_stage, to_stage)

    def release(self, hold: str) -> None:
        # producer: a payload that will not be read (its send failed): stop exposing it,
        # its blocks go once any in-flight lease ends. A consumer exposes nothing under a
        # producer's key; it lets go by discarding the payload (acquire + release).
        self.conn._exposed.retire_where(lambda k: k == hold)

    # -- consumer ------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, hold: Any) -> Iterator[None]:
        if not isinstance(hold, str) or not hold:
            raise KVPayloadError(f"shared-pages payload names no valid hold: {hold!r}")
        lease = self.conn.leases.current(hold)
        if lease is None:
            raise KVTransferError(
                f"no open stream holds a lease on {hold!r} in this thread: registered-cache "
                "pages are copied only while the payload's stream is open"
            )
        copied = False
        try:
            yield
            copied = True
        finally:
            live = lease.end(True)  # the producer's blocks are free to go after this
        if copied and not live:
            raise KVTransferError(
                "the producer took back this payload's blocks during the copy (its lease "
                "ran out, or the producer is gone): the request is recomputed"
            )

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
        """One part pulled as one move (:meth:`copy_all`)."""
        return self.copy_all(descriptor, [PageCopy(geometry, ident, caches, pairs, sums, first)])

    def copy_all(self, descriptor: Any, copies: Sequence[PageCopy], wait: bool = False) -> int:
        """Every part pulled as one move: one plan (bounds-checked against both caches
        before any byte moves), one engine call where the local cache is registered here.
        Returns once the pages are written."""
        session, base, size = self._remote(descriptor)
        # the producer's layer views over a meta tensor of its region's size: geometry is
        # bounds-checked without touching memory, and gives every page's remote offset
        region = torch.empty(size, dtype=torch.uint8, device="meta")
        parts: list[Part] = []
        direct = True
        for c in copies:
            if not c.pairs:
                continue
            src = attach_layers(region, c.geometry, c.ident, c.caches[0].dtype)
            dst = [page_view(x, c.ident) for x in c.caches]
            parts.append(([page_view(v, c.ident) for v in src], dst, c.pairs, c.sums, c.first))
            direct = direct and self._registered_here(c.caches)
        if not parts:
            return 0
        plan = MovePlan.stacked(parts, what="registered-cache payload")
        pull = PagePull(self.conn, session, time.monotonic() + self.conn.transfer_timeout_s)
        try:
            return pull.run(plan, base, direct)
        except BaseException:
            pull.drain()  # a read abandoned on timeout may still write into our cache
            raise

    def _remote(self, descriptor: Any) -> tuple[str, int, int]:
        if not isinstance(descriptor, dict) or descriptor.get("kind") != self.kind:
            raise KVPayloadError(f"not a {self.kind} registered cache region: {descriptor!r}")
        session, base, size = (
            descriptor.get("session"),
            descriptor.get("base"),
            descriptor.get("size"),
        )
        if (
            not is_session(session)
            or not isinstance(base, int)
            or not isinstance(size, int)
            or base <= 0
            or size <= 0
        ):
            raise KVPayloadError(f"registered-cache payload: bad region {descriptor!r:.200}")
        self._check_generation(session, descriptor)
        return session, base, size

    def _check_generation(self, session: str, descriptor: dict[str, Any]) -> None:
        """Refuse a payload of an older generation than one seen from its producer (it
        slept since); on a newer one, drop the engine's loaded view of that producer
        (where the engine keeps one: NIXL) so the next read handshakes again."""
        with self._lock:
            seen = self._seen.get(session, 0)
            got = descriptor.get("generation", 0)
            if isinstance(got, int) and got > seen:
                self._seen[session] = got
            if session in self._seen:
                self._seen.move_to_end(session)
                while len(self._seen) > MAX_SEEN:  # a forgotten producer: its next generation
                    self._seen.popitem(last=False)  # seen counts as its newest
        check_generation(descriptor, max(seen, got) if isinstance(got, int) else seen)
        forget = getattr(self.conn.engine, "forget", None)
        if got != seen and forget is not None:
            forget(session)  # the producer registered its cache again

    def _registered_here(self, caches: Sequence[torch.Tensor]) -> bool:
        """Whether ``caches`` lie in this process's registered cache (reads land there)."""
        t = self.tensor
        if t is None or self._registered is None or caches[0].device != t.device:
            return False
        return layer_geometry(caches, t.data_ptr(), int(t.numel())) is not None

    def close(self) -> None:
        """Unregister the cache (vLLM's views keep its memory alive); holds are taken back
        by the connector's shared sends, exposures freed by the connector."""
        with self._lock:
            addrs, self._spans, self._registered = list(self._spans), {}, None
        if self.asleep:  # unregistered already
            addrs = []
        for addr in addrs:
            self._unregister(addr)


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


class CacheRegionConnector(PullTransferConnector):
    """A pull connector with the ``register_cache`` option (Mooncake TE and NIXL).

    ``register_cache`` (default false): register this engine's KV cache with the
    connector's engine (:class:`TECacheRegion`), so that consumers pull the pages they
    lack straight out of it and payloads are small frames of block ids; set it on both
    stages. ``verify_pages`` (default false; host caches): a digest per page, verified
    by consumers."""

    CONFIG_KEYS: ClassVar[frozenset[str]] = PullTransferConnector.CONFIG_KEYS | {
        "register_cache",
        "verify_pages",
    }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = config or {}
        register = _flag(cfg.get("register_cache", False), "register_cache")
        pages = _flag(cfg.get("verify_pages", False), "verify_pages")
        super().__init__(config)
        if register:
            self.cache_region = TECacheRegion(self)
            self.cache_region.digests = pages

    def close(self) -> None:
        """Unregister the KV cache (``register_cache``), then close the connector."""
        if self.cache_region is not None and not self._closed:
            self.cache_region.close()
        super().close()
