"""The consumer's reads of a ``register_cache`` copy: pages out of a producer's cache.

One move (every part of a payload: its layer groups, its state pages) is one
:class:`~vllm_omni_kv.kvcache.move_plan.MovePlan`. Where the consumer's own cache is
registered too, the pages are read straight into it as one engine call
(:class:`~vllm_omni_kv.backends.pull.page_reads.PageReads`: one post by index into
prepared descriptor lists where the engine has them, else one batch of coalesced
ranges); otherwise each run goes through a block of the connector's registered pool (at
most :data:`STAGE_BYTES` at a time) and is copied into the cache from there. Every read
is bounded by the copy's deadline (``transfer_timeout_s``); page digests, when the
payload carries them, are verified once the pages are in. The plan has bounds-checked
every page against both caches.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.pull.page_reads import PageReads, Read
from vllm_omni_kv.backends.pull.puller import when_reads_end
from vllm_omni_kv.kvcache.move_plan import MovePlan, Run
from vllm_omni_kv.kvcache.page_digests import check_pages
from vllm_omni_kv.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni_kv.backends.pull.pull import PullTransferConnector

logger = init_logger(__name__)

#: largest pool block a staged pull (consumer cache not registered) reads at a time
STAGE_BYTES = 4 << 20
#: how often a failed copy waiting for reads still writing into the consumer's cache logs
DRAIN_S = 10.0
WHAT = "registered cache pages"

#: one page of a staged pull: (layer, remote address, local page, payload page)
_Item = tuple[int, int, int, int]


def _chunks(plan: MovePlan, base: int) -> Iterator[list[_Item]]:
    """The plan's pages, layer by layer, in chunks of at most :data:`STAGE_BYTES` (at
    least one page each)."""
    chunk: list[_Item] = []
    size = 0
    for g in plan.groups:
        for layer in g.layers:
            sp, per = plan.src[layer], plan.page_bytes(layer)
            esize = sp.element_size()
            at, stride = base + int(sp.storage_offset()) * esize, sp.stride(0) * esize
            for j, (s, d) in enumerate(g.pairs):
                if chunk and size + per > STAGE_BYTES:
                    yield chunk
                    chunk, size = [], 0
                chunk.append((layer, at + s * stride, d, g.first + j))
                size += per
    if chunk:
        yield chunk


def _merged(reads: list[Read]) -> list[Read]:
    """``reads`` with each range that continues the previous one on both sides merged."""
    out: list[Read] = []
    for local, remote, n in reads:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((local, remote, n))
    return out


class PagePull:
    """The engine reads of one move from the producer at ``session``; ``reads`` holds the
    future of every read issued (:meth:`drain` waits for them after a failure)."""

    def __init__(self, conn: PullTransferConnector, session: str, deadline: float) -> None:
        self.conn, self.session, self.deadline = conn, session, deadline
        self.reads: list[cf.Future[None]] = []

    def run(self, plan: MovePlan, base: int, direct: bool) -> int:
        """Pull every page of ``plan`` (its source views over the producer's region at
        ``base``); ``direct``: its destination views lie in this process's registered
        cache. Bytes moved."""
        if direct:
            reads = PageReads.of_plan(plan, base)
            self.conn._puller.read_pages(
                self.session, reads, self.deadline, what=WHAT, keep=plan.dst, track=self.reads
            )
            for g in plan.groups:  # once every page is in
                for layer in g.layers:
                    self._check(plan, layer, g.first, g.runs)
        else:
            for chunk in _chunks(plan, base):
                self._staged(plan, chunk)
        return plan.nbytes

    @staticmethod
    def _check(plan: MovePlan, layer: int, first: int, runs: list[Run]) -> None:
        """Verify ``layer``'s pages written by ``runs`` against the payload's digests."""
        sums = plan.digests(layer)
        if sums is not None:
            for i0, _s0, d0, n in runs:
                check_pages(plan.dst[layer], d0, n, sums, first + i0, layer, WHAT)

    def _staged(self, plan: MovePlan, chunk: list[_Item]) -> None:
        """Read ``chunk``'s pages into one block of the pool (one engine call), verify
        them there, then copy each layer's pages into its cache (one op per layer)."""
        pers = [plan.page_bytes(it[0]) for it in chunk]
        buf = self.conn.pool.alloc(sum(pers))
        try:
            offsets = [0, *itertools.accumulate(pers)]
            reads = _merged([(buf.address + o, it[1], n) for it, o, n in zip(chunk, offsets, pers)])
            self.conn._puller.read_many(
                self.session, reads, self.deadline, what=WHAT, keep=buf, track=self.reads
            )
            at = 0
            for layer, items in itertools.groupby(chunk, key=lambda it: it[0]):
                got = list(items)
                dp, per = plan.dst[layer], plan.page_bytes(layer)
                rows = buf.tensor[at : at + len(got) * per].view(dp.dtype)
                staged = rows.view(len(got), *dp.shape[1:])
                sums = plan.digests(layer)
                if sums is not None:  # a layer's pages in a chunk are consecutive payload pages
                    check_pages(staged, 0, len(got), sums, got[0][3], layer, WHAT)
                ids = torch.tensor([it[2] for it in got], dtype=torch.long, device=dp.device)
                dp.index_copy_(0, ids, staged.to(dp.device))
                at += len(got) * per
        finally:
            self._release_after(buf)

    def _release_after(self, buf: ManagedBuffer) -> None:
        """Free the staging block ``buf`` once no read into it is running (an abandoned read
        may still write into it)."""
        when_reads_end(self.reads, buf.release)

    def drain(self) -> None:
        """After a failure: wait for every read still writing into the local cache (one
        given up on lands bytes until its transfer ends), logging each :data:`DRAIN_S`.
        The load is reported failed only then, so vLLM never reuses pages under a read."""
        waited = 0.0
        while cf.wait(self.reads, timeout=DRAIN_S).not_done:
            waited += DRAIN_S
            logger.error(
                "a registered-cache read still runs %gs after its copy failed; the pages it "
                "writes stay with their request until it ends",
                waited,
            )
