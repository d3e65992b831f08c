"""The producer's KV cache registered with the Mooncake Transfer Engine (``register_cache``).

Producer: inside :meth:`TECacheRegion.allocation_context` vLLM's one host allocation of
the KV cache becomes a page-aligned anonymous mapping registered with the connector's
transfer engine. A payload is then a small shared-pages frame (block ids, layer
geometry, page digests) put in the pool as usual; consumers pull the pages they lack
straight out of the registered cache with engine reads: no staging copy on the
producer.

Holds are the pull protocol's exposure of that small frame (its edge key): the
consumer's stream on the frame holds a lease for the whole copy (``SharedCopy.apply``
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

import concurrent.futures as cf
import contextlib
import ctypes
import math
import mmap
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from vllm_omni_kv.backends.cache_region import AllocateHostCache, CacheRegion
from vllm_omni_kv.backends.keys import edge_key
from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.transfer_engine.pull_stream import when_reads_end
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, dense_pages, page_view
from vllm_omni_kv.kvcache.shared_pages import attach_layers, layer_geometry, page_runs
from vllm_omni_kv.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni_kv.backends.transfer_engine.pull import PullTransferConnector

logger = init_logger(__name__)

KIND = "mooncake_te"
#: largest pool block a staged pull (consumer cache not registered) reads at a time
STAGE_BYTES = 4 << 20
#: ranges per batched engine read (Mooncake over TCP failed a batch of 4096 64 KiB ranges)
BATCH_READS = 256
#: how long a failed copy waits for reads still writing into the consumer's cache
DRAIN_S = 10.0


def _direct_reads(
    s_base: int,
    s_stride: int,
    dp: torch.Tensor,
    d_stride: int,
    per: int,
    s0: int,
    d0: int,
    n: int,
) -> list[tuple[int, int, int]]:
    """``(local, remote, bytes)`` reads of pages ``s0..s0+n`` into pages ``d0..`` of ``dp``."""
    local = dp.data_ptr() + d0 * d_stride
    remote = s_base + s0 * s_stride
    if s_stride == per == d_stride:
        return [(local, remote, n * per)]
    return [(local + j * d_stride, remote + j * s_stride, per) for j in range(n)]


def _check_digests(
    addr: int, per: int, n: int, sums: list[int], p0: int, layer: int, stride: int
) -> None:
    """Verify ``n`` pages of host memory at ``addr`` (``stride`` bytes apart)."""
    for j in range(n):
        page = (ctypes.c_char * per).from_address(addr + j * stride)
        if xxhash.xxh3_64_intdigest(memoryview(page).cast("B")) != sums[p0 + j]:
            raise KVPayloadError(
                f"registered-cache pull: layer {layer} page {p0 + j} does not match the "
                "producer's digest (its block was rewritten while being read)"
            )


def _release_after(buf: ManagedBuffer, reads: list[cf.Future[None]]) -> None:
    """Free the staging block ``buf`` once no read into it is running (an abandoned read
    may still write into it)."""
    when_reads_end(reads, buf.release)


class TECacheRegion(CacheRegion):
    """A host KV cache registered with the connector's transfer engine (both roles)."""

    kind = KIND

    def __init__(self, conn: PullTransferConnector) -> None:
        self.conn = conn
        self.tensor: torch.Tensor | None = None
        self._map: mmap.mmap | None = None
        self._registered: int | None = None  # base address while registered
        self._lock = threading.Lock()

    # -- producer (and consumer: its own cache is registered too) ------------------------
    def allocation_context(self) -> AllocateHostCache:
        return AllocateHostCache(self.allocate)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed, page-aligned ``int8`` host tensor of ``nbytes``, registered with the
        transfer engine."""
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        tensor = torch.frombuffer(mm, dtype=torch.int8, count=nbytes)
        addr = tensor.data_ptr()
        self.conn.engine.register(addr, nbytes)
        with self._lock:
            self._map, self.tensor, self._registered = mm, tensor, addr
        logger.info(
            "KV cache (%.1f MiB) registered with the transfer engine at %s: consumers pull "
            "its pages directly",
            nbytes / 2**20,
            self.conn.engine.session,
        )
        return tensor

    def export(self, caches: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int, int] | None:
        if self.tensor is None or not caches:
            return None
        base, nbytes = self.tensor.data_ptr(), int(self.tensor.numel())
        if layer_geometry(caches, base, nbytes) is None:
            return None
        desc = {"kind": KIND, "session": self.conn.engine.session, "base": base, "size": nbytes}
        return desc, base, nbytes

    def hold(self, from_stage: str, to_stage: str, key: str) -> str:
        name = self.hold_name(from_stage, to_stage, key)
        if self.conn._exposed.exposed(name):
            raise KVTransferError(
                f"a payload under key {key!r} on {from_stage}->{to_stage} is still held: use "
                "a unique key per transfer"
            )
        return name

    def released(self, hold: str) -> bool:
        return not self.conn._exposed.exposed(hold)

    def take_back(self, hold: str) -> bool:
        return self.conn._exposed.withdraw(hold)

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
        session, base, size = self._remote(descriptor)
        dtype = caches[0].dtype
        # the producer's layer views over a meta tensor of its region's size: geometry is
        # bounds-checked without touching memory, and gives every page's remote offset
        src = attach_layers(
            torch.empty(size, dtype=torch.uint8, device="meta"), geometry, ident, dtype
        )
        src_pages = [page_view(v, ident) for v in src]
        dst_pages = [page_view(c, ident) for c in caches]
        if not pairs:
            return 0
        s_ids, d_ids = [s for s, _ in pairs], [d for _, d in pairs]
        n_src = min(int(p.shape[0]) for p in src_pages)
        n_dst = min(int(p.shape[0]) for p in dst_pages)
        if min(s_ids) < 0 or max(s_ids) >= n_src or min(d_ids) < 0 or max(d_ids) >= n_dst:
            raise KVPayloadError(
                f"shared-pages payload: source pages {min(s_ids)}..{max(s_ids)} of the "
                f"producer's {n_src} or destination pages {min(d_ids)}..{max(d_ids)} of "
                f"{n_dst} lie outside a cache (a corrupt payload)"
            )
        direct = self._registered_here(caches)
        deadline = time.monotonic() + self.conn.transfer_timeout_s
        reads: list[cf.Future[None]] = []
        try:
            return self._pull(
                session, base, src_pages, dst_pages, pairs, sums, first, direct, deadline, reads
            )
        except BaseException:
            # a read abandoned on timeout may still write into the local cache: wait
            cf.wait(reads, timeout=DRAIN_S)
            if any(not f.done() for f in reads):
                logger.error("a registered-cache read did not end within %gs of failing", DRAIN_S)
            raise

    def _remote(self, descriptor: Any) -> tuple[str, int, int]:
        if not isinstance(descriptor, dict) or descriptor.get("kind") != KIND:
            raise KVPayloadError(f"not a Mooncake registered cache region: {descriptor!r}")
        session, base, size = (
            descriptor.get("session"),
            descriptor.get("base"),
            descriptor.get("size"),
        )
        if (
            not isinstance(session, str)
            or not session
            or not isinstance(base, int)
            or not isinstance(size, int)
            or base <= 0
            or size <= 0
        ):
            raise KVPayloadError(f"registered-cache payload: bad region {descriptor!r}")
        return session, base, size

    def _registered_here(self, caches: Sequence[torch.Tensor]) -> bool:
        """Whether ``caches`` lie in this process's registered cache (reads land there)."""
        t = self.tensor
        if t is None or self._registered is None or caches[0].device.type != "cpu":
            return False
        return layer_geometry(caches, t.data_ptr(), int(t.numel())) is not None

    def _read(
        self,
        session: str,
        local: int,
        remote: int,
        n: int,
        deadline: float,
        keep: Any,
        reads: list[cf.Future[None]],
    ) -> None:
        self.conn._puller.read(
            session,
            local,
            remote,
            n,
            deadline,
            None,
            what="registered cache pages",
            keep=keep,
            track=reads,
        )

    def _pull(
        self,
        session: str,
        base: int,
        src_pages: list[torch.Tensor],
        dst_pages: list[torch.Tensor],
        pairs: Sequence[tuple[int, int]],
        sums: list[list[int]] | None,
        first: int,
        direct: bool,
        deadline: float,
        reads: list[cf.Future[None]],
    ) -> int:
        moved = 0
        runs = page_runs(pairs)
        batch: list[tuple[int, int, int]] = []  # direct reads, issued together below
        checks: list[tuple[int, int, int, list[int], int, int, int]] = []
        for layer, (sp, dp) in enumerate(zip(src_pages, dst_pages, strict=True)):
            esize = sp.element_size()
            per = math.prod(sp.shape[1:]) * esize
            if not dense_pages(sp, host=False) or sp.stride(0) * esize < per:
                raise KVPayloadError(
                    f"registered-cache payload: layer {layer}'s pages are not contiguous in "
                    "the producer's cache; they cannot be pulled by address"
                )
            s_stride = sp.stride(0) * esize
            s_base = base + int(sp.storage_offset()) * esize
            here = direct and dense_pages(dp, host=False) and dp.stride(0) * esize >= per
            d_stride = dp.stride(0) * esize
            for i0, s0, d0, n in runs:
                if here:
                    batch += _direct_reads(s_base, s_stride, dp, d_stride, per, s0, d0, n)
                    if sums is not None:
                        addr = dp.data_ptr() + d0 * d_stride
                        checks.append((addr, per, n, sums[layer], first + i0, layer, d_stride))
                else:
                    self._staged(
                        session,
                        s_base,
                        s_stride,
                        dp,
                        per,
                        s0,
                        d0,
                        n,
                        deadline,
                        reads,
                        sums,
                        layer,
                        first + i0,
                    )
                moved += n * per
        for i in range(0, len(batch), BATCH_READS):  # bounded batches (one is refused whole)
            self.conn._puller.read_many(
                session,
                batch[i : i + BATCH_READS],
                deadline,
                what="registered cache pages",
                keep=dst_pages,
                track=reads,
            )
            for check in checks:
                _check_digests(*check)
        return moved

    def _staged(
        self,
        session: str,
        s_base: int,
        s_stride: int,
        dp: torch.Tensor,
        per: int,
        s0: int,
        d0: int,
        n: int,
        deadline: float,
        reads: list[cf.Future[None]],
        sums: list[list[int]] | None,
        layer: int,
        p0: int,
    ) -> None:
        """Pull pages through a block of the registered pool, then copy them into ``dp``."""
        step = max(1, STAGE_BYTES // per)
        for j in range(0, n, step):
            k = min(step, n - j)
            buf = self.conn.pool.alloc(k * per)
            try:
                remote = s_base + (s0 + j) * s_stride
                if s_stride == per:
                    self._read(session, buf.address, remote, k * per, deadline, buf, reads)
                else:
                    for i in range(k):
                        self._read(
                            session,
                            buf.address + i * per,
                            remote + i * s_stride,
                            per,
                            deadline,
                            buf,
                            reads,
                        )
                if sums is not None and buf.tensor.device.type == "cpu":
                    _check_digests(buf.address, per, k, sums[layer], p0 + j, layer, per)
                staged = buf.tensor[: k * per].view(dp.dtype).view(k, *dp.shape[1:])
                dp[d0 + j : d0 + j + k].copy_(staged)
            finally:
                _release_after(buf, reads)

    def close(self) -> None:
        """Unregister the cache (vLLM's views keep its mapping alive); holds are taken back
        by the connector's shared sends, exposures freed by the connector."""
        with self._lock:
            addr, self._registered = self._registered, None
        if addr is not None:
            try:
                self.conn.engine.unregister(addr)
            except Exception as e:
                logger.debug("unregistering the KV cache: %s", e)
