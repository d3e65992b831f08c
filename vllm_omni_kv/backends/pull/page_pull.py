"""The consumer's reads of a ``register_cache`` copy: page runs out of a producer's cache.

Pages consecutive on both sides (per layer) are one range. Where the consumer's own
cache is registered too, ranges are read straight into it, in bounded batches of
engine reads; otherwise each run goes through a block of the connector's registered
pool (at most :data:`STAGE_BYTES` at a time) and is copied into the cache from there.
Every read is bounded by the copy's deadline (``transfer_timeout_s``); page digests,
when the payload carries them, are verified once the pages are in. The caller has
bounds-checked every page against both caches (see
:meth:`~vllm_omni_kv.backends.pull.cache_region.TECacheRegion.copy_into`).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.pull.pull_stream import when_reads_end
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import dense_pages
from vllm_omni_kv.kvcache.shared_pages import check_pages, page_runs
from vllm_omni_kv.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni_kv.backends.pull.pull import PullTransferConnector

logger = init_logger(__name__)

#: largest pool block a staged pull (consumer cache not registered) reads at a time
STAGE_BYTES = 4 << 20
#: ranges per batched engine read (Mooncake over TCP failed a batch of 4096 64 KiB ranges)
BATCH_READS = 256
#: how long a failed copy waits for reads still writing into the consumer's cache
DRAIN_S = 10.0
WHAT = "registered cache pages"

Read = tuple[int, int, int]  # (local address, remote address, bytes)


def _direct_reads(
    s_base: int, s_stride: int, dp: torch.Tensor, d_stride: int, per: int, s0: int, d0: int, n: int
) -> list[Read]:
    """Reads of pages ``s0..s0+n`` into pages ``d0..`` of ``dp``."""
    local = dp.data_ptr() + d0 * d_stride
    remote = s_base + s0 * s_stride
    if s_stride == per == d_stride:
        return [(local, remote, n * per)]
    return [(local + j * d_stride, remote + j * s_stride, per) for j in range(n)]


class PagePull:
    """The engine reads of one copy from the producer at ``session``; ``reads`` holds the
    future of every read issued (:meth:`drain` waits for them after a failure)."""

    def __init__(self, conn: PullTransferConnector, session: str, deadline: float) -> None:
        self.conn, self.session, self.deadline = conn, session, deadline
        self.reads: list[cf.Future[None]] = []

    def _read(self, reads: list[Read], keep: object) -> None:
        self.conn._puller.read_many(
            self.session, reads, self.deadline, what=WHAT, keep=keep, track=self.reads
        )

    def run(
        self,
        base: int,
        src_pages: list[torch.Tensor],
        dst_pages: list[torch.Tensor],
        pairs: Sequence[tuple[int, int]],
        sums: list[list[int]] | None,
        first: int,
        direct: bool,
    ) -> int:
        """Pull producer page ``s`` into page ``d`` of every layer for ``(s, d)`` in
        ``pairs`` (``src_pages``: the producer's page views over its region, at ``base``);
        ``direct``: ``dst_pages`` lie in this process's registered cache. Bytes moved."""
        moved = 0
        runs = page_runs(pairs)
        batch: list[Read] = []  # direct reads, issued together below
        checks: list[tuple[torch.Tensor, int, int, list[int], int, int]] = []
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
                        checks.append((dp, d0, n, sums[layer], first + i0, layer))
                else:
                    remote = s_base + s0 * s_stride
                    self._staged(remote, s_stride, dp, per, d0, n, sums, layer, first + i0)
                moved += n * per
        for i in range(0, len(batch), BATCH_READS):  # bounded batches (one is refused whole)
            self._read(batch[i : i + BATCH_READS], dst_pages)
        for check in checks:  # once every batch is in
            check_pages(*check, what="registered-cache pull")
        return moved

    def _staged(
        self,
        remote: int,
        s_stride: int,
        dp: torch.Tensor,
        per: int,
        d0: int,
        n: int,
        sums: list[list[int]] | None,
        layer: int,
        p0: int,
    ) -> None:
        """Pull ``n`` pages at ``remote`` (``s_stride`` apart) through blocks of the pool,
        then copy them into pages ``d0..`` of ``dp``."""
        step = max(1, STAGE_BYTES // per)
        for j in range(0, n, step):
            k = min(step, n - j)
            buf = self.conn.pool.alloc(k * per)
            try:
                at = remote + j * s_stride
                if s_stride == per:
                    self._read([(buf.address, at, k * per)], buf)
                else:
                    self._read(
                        [(buf.address + i * per, at + i * s_stride, per) for i in range(k)], buf
                    )
                staged = buf.tensor[: k * per].view(dp.dtype).view(k, *dp.shape[1:])
                if sums is not None:  # in the pool block (the destination may be strided)
                    check_pages(staged, 0, k, sums[layer], p0 + j, layer, "registered-cache pull")
                dp[d0 + j : d0 + j + k].copy_(staged)
            finally:
                self._release_after(buf)

    def _release_after(self, buf: ManagedBuffer) -> None:
        """Free the staging block ``buf`` once no read into it is running (an abandoned read
        may still write into it)."""
        when_reads_end(self.reads, buf.release)

    def drain(self) -> None:
        """After a failure: wait (bounded) for reads still writing into the local cache."""
        cf.wait(self.reads, timeout=DRAIN_S)
        if any(not f.done() for f in self.reads):
            logger.error("a registered-cache read did not end within %gs of failing", DRAIN_S)
