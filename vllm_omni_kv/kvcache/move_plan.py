"""One move of pages between two paged caches: what goes where, checked once.

A :class:`MovePlan` is built once per move (a load's copy out of a producer's cache, a
staging gather, an injection) from per-layer page views (``[pages, ...]``, each layer's
own page shape) and one or more :class:`Pages` groups: layers that share the same
``(source page, destination page)`` pairs. Building it

- bounds-checks every pair against every layer of its group, on both sides, and the
  page shapes of each layer pair (``KVPayloadError`` before any byte moves);
- coalesces each group's pairs into runs consecutive on both sides (``runs``) and
  packs them for the native host copy (``table``);
- keeps the page ids of every group in one int64 tensor, uploaded to a device at most
  once per plan (:meth:`MovePlan.indices`; from pinned memory, ``non_blocking``, where
  the device is CUDA).

A mover (:mod:`~vllm_omni_kv.kvcache.movers`) then moves the bytes for the memory kinds
involved; neither side grows its device operations or host waits with the page count.

Example (H2D staging: a staging buffer is just another page view)::

    plan = MovePlan(src_pages, staging_pages, [Pages(range(L), [(b, j) for j, b in ...])])
    movers.move(plan)
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.page_copy import pack_runs

Pair = tuple[int, int]  # (source page, destination page)
Run = tuple[int, int, int, int]  # (index of its first pair, source page, destination page, n)
#: one part of a stacked plan: (source page views, destination page views, pairs, sums, first)
Part = tuple[
    Sequence[torch.Tensor],
    Sequence[torch.Tensor],
    Sequence[Pair],
    Sequence[Sequence[int] | None] | None,
    int,
]


@dataclass(frozen=True)
class Pages:
    """Layers (indices into the plan's page views) that move the same page pairs.
    ``first``: the payload page of ``pairs[0]`` (``sums[layer][first + j]`` is the digest
    of the page ``pairs[j]`` writes)."""

    layers: Sequence[int]
    pairs: Sequence[Pair]
    first: int = 0


def page_runs(pairs: Sequence[Pair]) -> list[Run]:
    """``(index of first pair, src id, dst id, n)`` for runs consecutive on both sides."""
    runs: list[Run] = []
    for i, (s, d) in enumerate(pairs):
        if runs:
            i0, s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (i0, s0, d0, n + 1)
                continue
        runs.append((i, s, d, 1))
    return runs


@dataclass
class PlanGroup:
    """One checked group: its layers, pairs (payload order), runs and native run table
    (sorted by source page, so reads go forward)."""

    layers: list[int]
    pairs: list[Pair]
    first: int
    runs: list[Run]
    table: array  # type: ignore[type-arg]
    span: tuple[int, int] = (0, 0)  # its ids' columns in the plan's index tensor


@dataclass
class MovePlan:
    """Pages ``src[l][s]`` to ``dst[l][d]`` for each group's layers ``l`` and pairs
    ``(s, d)``; ``sums``: per layer, the payload's page digests to verify the written
    pages against (None: no verification; a None row: that layer unverified).
    ``what`` names the payload in errors."""

    src: Sequence[torch.Tensor]
    dst: Sequence[torch.Tensor]
    pages: Iterable[Pages]
    sums: Sequence[Sequence[int] | None] | None = None
    what: str = "shared-pages payload"
    groups: list[PlanGroup] = field(init=False)
    _per: list[int] = field(init=False, default_factory=list)  # page bytes per grouped layer
    _host_ids: torch.Tensor | None = field(init=False, default=None)
    _uploaded: dict[str, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise KVPayloadError(
                f"{self.what}: {len(self.src)} source layers for {len(self.dst)} destination "
                "layers (serve both stages with the same model)"
            )
        self.groups = []
        self._per = [0] * len(self.src)
        seen: set[int] = set()
        col = 0
        for p in self.pages:
            layers, pairs = [int(i) for i in p.layers], [(int(s), int(d)) for s, d in p.pairs]
            if not layers or not pairs:
                continue
            if seen.intersection(layers) or min(layers) < 0 or max(layers) >= len(self.src):
                raise KVPayloadError(f"{self.what}: layer groups {layers} overlap or out of range")
            seen.update(layers)
            self._check(layers, pairs)
            runs = page_runs(pairs)
            table = pack_runs(sorted((s0, d0, n) for _i0, s0, d0, n in runs))
            self.groups.append(PlanGroup(layers, pairs, int(p.first), runs, table))
            self.groups[-1].span = (col, col + len(pairs))
            col += len(pairs)
        if self.sums is not None and len(self.sums) != len(self.src):
            raise KVPayloadError(f"{self.what}: page digests for {len(self.sums)} layers")

    @classmethod
    def whole(
        cls,
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        pairs: Sequence[Pair],
        sums: Sequence[Sequence[int] | None] | None = None,
        first: int = 0,
        what: str = "shared-pages payload",
    ) -> MovePlan:
        """Every layer moves the same ``pairs`` (one group)."""
        return cls(src, dst, [Pages(range(len(src)), pairs, first)], sums, what)

    @classmethod
    def stacked(cls, parts: Sequence[Part], what: str = "shared-pages payload") -> MovePlan:
        """One plan of several parts, each ``(src views, dst views, pairs, sums, first)``
        (its layers one group): e.g. a hybrid model's attention groups and state pages."""
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        pages: list[Pages] = []
        sums: list[Sequence[int] | None] = []
        for p_src, p_dst, pairs, p_sums, first in parts:
            pages.append(Pages(range(len(src), len(src) + len(p_src)), pairs, first))
            src += p_src
            dst += p_dst
            sums += [None] * len(p_src) if p_sums is None else list(p_sums)
        verified = any(s is not None for s in sums)
        return cls(src, dst, pages, sums if verified else None, what)

    def _check(self, layers: list[int], pairs: list[Pair]) -> None:
        s_ids, d_ids = [s for s, _ in pairs], [d for _, d in pairs]
        shapes = [(self.src[i].shape, self.dst[i].shape) for i in layers]
        n_src, n_dst = min(int(s[0]) for s, _ in shapes), min(int(d[0]) for _, d in shapes)
        if min(s_ids) < 0 or max(s_ids) >= n_src or min(d_ids) < 0 or max(d_ids) >= n_dst:
            raise KVPayloadError(
                f"{self.what}: source pages {min(s_ids)}..{max(s_ids)} of the producer's "
                f"{n_src} or destination pages {min(d_ids)}..{max(d_ids)} of {n_dst} lie "
                "outside a cache (a corrupt payload)"
            )
        for i, (ss, ds) in zip(layers, shapes, strict=True):
            page, esize, d_esize = ss[1:], self.src[i].element_size(), self.dst[i].element_size()
            if page != ds[1:] or esize != d_esize:
                raise KVPayloadError(
                    f"{self.what}: layer {i}'s pages {tuple(page)} x {esize} B do not fit the "
                    f"local {tuple(ds[1:])} x {d_esize} B (serve both stages with the same "
                    "KV layout)"
                )
            self._per[i] = math.prod(page) * esize

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer``."""
        if self._per[layer]:
            return self._per[layer]
        pv = self.src[layer]
        return math.prod(pv.shape[1:]) * pv.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes the move writes."""
        return sum(len(g.pairs) * self.page_bytes(i) for g in self.groups for i in g.layers)

    @property
    def num_pairs(self) -> int:
        return sum(len(g.pairs) for g in self.groups)

    def digests(self, layer: int) -> Sequence[int] | None:
        """The payload digests of ``layer``'s pages, or None when it is not verified."""
        return None if self.sums is None else self.sums[layer]

    def host_ids(self, pin: bool = False) -> torch.Tensor:
        """``[2, pairs]`` int64: every group's source ids, then destination ids, in pair
        order (built once; ``pin``: in pinned memory, for an upload to CUDA)."""
        if self._host_ids is None or (pin and not self._host_ids.is_pinned()):
            flat = [[s for g in self.groups for s, _ in g.pairs]]
            flat.append([d for g in self.groups for _, d in g.pairs])
            host = torch.tensor(flat, dtype=torch.int64).reshape(2, -1)
            self._host_ids = host.pin_memory() if pin and torch.cuda.is_available() else host
        return self._host_ids

    def upload(self, device: torch.device) -> None:
        """Queue the one copy of :meth:`host_ids` to ``device`` on the calling thread's
        current stream (``non_blocking``), unless done already or ``device`` is the host."""
        key = str(device)
        if key not in self._uploaded:
            host = self.host_ids(pin=device.type == "cuda")
            up = host if device.type == "cpu" else host.to(device, non_blocking=True)
            self._uploaded[key] = up

    def indices(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, ``(source ids, destination ids)`` on ``device`` (views of the one
        upload, :meth:`upload`), in pair order."""
        self.upload(device)
        ids = self._uploaded[str(device)]
        return [(ids[0, a:b], ids[1, a:b]) for a, b in (g.span for g in self.groups)]
