"""One move's engine reads out of a producer's registered cache, as tables and indices.

A :class:`~vllm_omni_kv.kvcache.move_plan.MovePlan` whose source views lie in a peer's
registered memory (at ``base``) and whose destination views lie in this process's
becomes :class:`PageReads`: every layer of either side is a :class:`PageTable` (pages at
a fixed stride), and the move is two index arrays into the concatenated tables, one
entry per page read. An engine with prepared descriptor lists (NIXL) prepares each
side's tables once and posts the whole move as one transfer by index; other engines
read :meth:`PageReads.ranges`, the same pages coalesced into byte ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import dense_pages
from vllm_omni_kv.kvcache.move_plan import MovePlan

Read = tuple[int, int, int]  # (local address, remote address, bytes)
#: layers (table indices, int64 ``[k]``) moving the same ``(remote page, local page)`` pairs
#: (int64 ``[n, 2]``)
Group = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class PageTable:
    """``count`` pages of ``page_bytes`` each at ``base + i * stride`` (one layer)."""

    base: int
    stride: int
    page_bytes: int
    count: int

    @property
    def extent(self) -> tuple[int, int]:
        """``(address, bytes)`` from the first page's start to the last page's end."""
        return self.base, (self.count - 1) * self.stride + self.page_bytes

    def row(self, device_id: int) -> tuple[int, int, int, int, int]:
        """The table as one strided descriptor: ``(address, bytes, device, stride, count)``."""
        return self.base, self.page_bytes, device_id, self.stride, self.count


def _table(pv: torch.Tensor, address: int, layer: int, side: str) -> PageTable:
    esize = pv.element_size()
    per = math.prod(pv.shape[1:]) * esize
    if not dense_pages(pv, host=False) or pv.stride(0) * esize < per:
        raise KVPayloadError(
            f"registered-cache payload: layer {layer}'s pages are not contiguous in the "
            f"{side} cache; they cannot be read by address"
        )
    return PageTable(address, pv.stride(0) * esize, per, int(pv.shape[0]))


def _starts(tables: list[PageTable]) -> np.ndarray:
    """Index of each table's first page in the concatenated tables."""
    return np.cumsum([0] + [t.count for t in tables[:-1]], dtype=np.int64)


def group_ids(
    remote: tuple[PageTable, ...], local: tuple[PageTable, ...], groups: tuple[Group, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``(remote ids, local ids)`` of ``groups``: indices into the concatenated tables, group
    by group, each group layer by layer."""
    r_at, l_at = _starts(list(remote)), _starts(list(local))
    r_ids, l_ids = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for layers, pairs in groups:
        r_ids.append((r_at[layers][:, None] + pairs[None, :, 0]).ravel())
        l_ids.append((l_at[layers][:, None] + pairs[None, :, 1]).ravel())
    return np.concatenate(r_ids), np.concatenate(l_ids)


@dataclass(frozen=True)
class PageReads:
    """Remote page ``remote_ids[j]`` into local page ``local_ids[j]``: indices into the
    concatenated ``remote`` (resp. ``local``) tables, in table order (table ``t``'s page
    ``i`` at ``sum(count of tables before t) + i``); ``nbytes`` in all. ``groups`` is the
    same move in the plan's compact form (:func:`group_ids` expands it)."""

    remote: tuple[PageTable, ...]
    local: tuple[PageTable, ...]
    remote_ids: np.ndarray
    local_ids: np.ndarray
    nbytes: int
    groups: tuple[Group, ...] = ()

    @classmethod
    def of_plan(cls, plan: MovePlan, remote_base: int) -> PageReads:
        """The reads of ``plan``, its source views over a meta tensor of the peer's region
        (their storage offsets are offsets from ``remote_base``), its destination views
        in local memory."""
        remote, local = [], []
        for i, (sp, dp) in enumerate(zip(plan.src, plan.dst, strict=True)):
            at = remote_base + int(sp.storage_offset()) * sp.element_size()
            remote.append(_table(sp, at, i, "producer's"))
            local.append(_table(dp, dp.data_ptr(), i, "local"))
        groups = tuple(
            (
                np.asarray(g.layers, dtype=np.int64),
                np.asarray(g.pairs, dtype=np.int64).reshape(-1, 2),
            )
            for g in plan.groups
        )
        r, lo = tuple(remote), tuple(local)
        return cls(r, lo, *group_ids(r, lo, groups), plan.nbytes, groups)

    def ranges(self) -> list[Read]:
        """The same reads as ``(local, remote, bytes)`` ranges: pages consecutive on both
        sides of one dense layer (pages back to back) merged into one range."""
        r_at, l_at = _starts(list(self.remote)), _starts(list(self.local))
        tables = np.searchsorted(r_at, self.remote_ids, side="right") - 1
        out: list[Read] = []
        run: list[int] = []  # [table, remote page, local page, pages]
        for t, r, d in zip(
            tables.tolist(), self.remote_ids.tolist(), self.local_ids.tolist(), strict=True
        ):
            s, p = r - int(r_at[t]), d - int(l_at[t])
            if (
                run
                and run[0] == t
                and run[1] + run[3] == s
                and run[2] + run[3] == p
                and self._dense(t)
            ):
                run[3] += 1
                continue
            if run:
                out.append(self._range(*run))
            run = [t, s, p, 1]
        if run:
            out.append(self._range(*run))
        return out

    def _dense(self, t: int) -> bool:
        rt, lt = self.remote[t], self.local[t]
        return rt.stride == rt.page_bytes and lt.stride == lt.page_bytes

    def _range(self, t: int, s: int, p: int, n: int) -> Read:
        rt, lt = self.remote[t], self.local[t]
        return lt.base + p * lt.stride, rt.base + s * rt.stride, n * rt.page_bytes
