"""Recurrent-state pages in a shared-pages payload: copied straight from the producer's cache.

A one-copy payload (:mod:`~vllm_omni_kv.kvcache.shared_pages`) of a hybrid model with
state layers (Mamba, gated delta net, short conv) names each state layer's page beside
its attention pages. ``metadata["shared"]["states"]`` is::

    {"geometry": [per state layer: [byte offset, shape, stride] of its
                  [blocks, 1, 1, C] uint8 view in the producer's region],
     "blocks":   [per state layer: the producer block holding the state],
     "sums":     [per state layer: the page's xxh3-64 digest] or None}

and ``metadata["state_layouts"]`` each state layer's :class:`StateLayoutId`, keyed by
its payload index (the attention layer count plus ``i``), as in a packed payload. ``C``
is the state's content: the padding vLLM adds to a state block does not move. The
consumer refuses a payload whose states do not match its own (count, identities) and
copies each page into its own state block under the payload's hold: one part
(:class:`~vllm_omni_kv.kvcache.shared_pages.PageCopy`) per block pair and page size, moved
with the attention pages in one plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, page_view
from vllm_omni_kv.kvcache.shared_pages import (
    PageCopy,
    is_layer_geometry,
    layer_geometry,
    page_sums,
)
from vllm_omni_kv.kvcache.state_pages import (
    STATE_LAYOUTS,
    StateLayoutId,
    check_declared_state,
)

STATES = "states"


def copy_ident(content_bytes: int) -> KVLayoutId:
    """The page identity a state page is copied under: one opaque cell of ``C`` bytes per
    block (a "packed" page of one head and one token), so every cache region's page
    copy moves it byte for byte."""
    return KVLayoutId("packed", "LBHNC", "uint8", 1, 1, 1, int(content_bytes), 1)


def state_view(pages: torch.Tensor) -> torch.Tensor:
    """The ``[blocks, 1, 1, C]`` view of a state layer's ``[blocks, C]`` uint8 pages."""
    return pages[:, None, None, :]


@dataclass(frozen=True)
class StatePage:
    """One state layer's pages, identity and the block of a request's state (the producer's
    block holding it, or the consumer's block it goes to)."""

    pages: torch.Tensor  # ``[blocks, C]`` uint8
    ident: StateLayoutId
    block: int


def state_geometry(
    pages: Sequence[torch.Tensor], base_ptr: int, nbytes: int
) -> list[list[Any]] | None:
    """Where each state layer's ``[blocks, 1, 1, C]`` view of ``pages`` lies in the region
    ``[base_ptr, base_ptr + nbytes)``; None when one lies outside it."""
    return layer_geometry([state_view(p) for p in pages], base_ptr, nbytes)


def describe_states(
    states: Sequence[StatePage], geometry: list[list[Any]], first_index: int, digests: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the shared "states" field, the "state_layouts" metadata)`` of ``states``, whose
    views lie at ``geometry`` (:func:`state_geometry`) in the exported region.
    ``first_index``: the payload index of the first state layer."""
    for s in states:
        if not 0 <= s.block < int(s.pages.shape[0]):
            raise KVPayloadError(f"state block {s.block} outside [0, {int(s.pages.shape[0])})")
    sums = None
    if digests:
        sums = [
            page_sums([page_view(state_view(s.pages), copy_ident(s.ident.content_bytes))],
                      [s.block])[0][0]
            for s in states
        ]  # fmt: skip
    owned = [[g[0], list(g[1]), list(g[2])] for g in geometry]  # the payload's own copy
    field = {"geometry": owned, "blocks": [s.block for s in states], "sums": sums}
    layouts = {str(first_index + i): s.ident.to_dict() for i, s in enumerate(states)}
    return field, {STATE_LAYOUTS: layouts}


@dataclass(frozen=True)
class StateCopyCall:
    """One copy call: state layers (payload order) sharing a block pair and a page size."""

    layers: list[int]
    pair: tuple[int, int]
    content_bytes: int


def _ints(raw: Any, n: int, what: str) -> list[int]:
    if (
        not isinstance(raw, list)
        or len(raw) != n
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
    ):
        raise KVPayloadError(f"shared-pages payload: state {what} must be {n} integers")
    return list(raw)


class SharedStates:
    """The state copies of one shared-pages payload into ``targets``, checked before
    anything is read: ``KVPayloadError`` for a malformed field, a state count or
    identity that differs from the local model's (the consumer then recomputes)."""

    def __init__(
        self,
        shared: dict[str, Any],
        metadata: dict[str, Any],
        targets: Sequence[StatePage],
        first_index: int,
    ) -> None:
        raw = shared.get(STATES)
        if raw is None and not targets:
            self.geometry: list[Any] = []
            self.sums: list[int] | None = None
            self.calls: list[StateCopyCall] = []
            self.targets: list[StatePage] = []
            return
        if raw is None or not targets:
            have, want = ("no", "keeps") if raw is None else ("", "does not keep")
            raise KVPayloadError(
                f"the payload carries {have} recurrent state (Mamba / GDN / short-conv "
                f"layers), which this model {want}: serve the same hybrid model on both stages"
            )
        n = len(targets)  # every list of the field must have this length
        if not isinstance(raw, dict):
            raise KVPayloadError("shared-pages payload: malformed states field")
        geometry = raw.get("geometry")
        if not isinstance(geometry, list) or len(geometry) != n:
            raise KVPayloadError(
                f"shared-pages payload: state geometry for {n} layers expected (this model's)"
            )
        blocks = _ints(raw.get("blocks"), n, "blocks")
        sums = raw.get("sums")
        self.sums = None if sums is None else _ints(sums, n, "digests")
        self.geometry, self.targets = geometry, list(targets)
        self.calls = self._plan(metadata, blocks, first_index)

    def _plan(
        self, metadata: dict[str, Any], blocks: list[int], first_index: int
    ) -> list[StateCopyCall]:
        declared = metadata.get(STATE_LAYOUTS)
        if not isinstance(declared, dict):
            raise KVPayloadError("shared-pages payload: no state layouts")
        calls: dict[tuple[int, int, int], list[int]] = {}
        for i, (t, src) in enumerate(zip(self.targets, blocks, strict=True)):
            check_declared_state(declared, first_index + i, t.ident)
            if not 0 <= t.block < int(t.pages.shape[0]):
                raise KVPayloadError(f"state layer {i}: local state block {t.block} out of range")
            g = self.geometry[i]
            want = [1, 1, t.ident.content_bytes]
            if (
                not is_layer_geometry(g)
                or g[1][1:] != want
                or min(g[2]) < 0
                or not 0 <= src < g[1][0]
            ):
                raise KVPayloadError(
                    f"shared-pages payload: state layer {i}'s geometry {g!r} or block {src} "
                    f"does not fit its [blocks, {', '.join(map(str, want))}] state pages"
                )
            calls.setdefault((src, t.block, t.ident.content_bytes), []).append(i)
        return [StateCopyCall(ls, (s, d), c) for (s, d, c), ls in calls.items()]

    def copies(self, verify: bool) -> list[PageCopy]:
        """The state pages as parts of the load's one move (under the payload's hold):
        one part per block pair and page size, its layers one group."""
        return [
            PageCopy(
                [self.geometry[i] for i in call.layers],
                copy_ident(call.content_bytes),
                [state_view(self.targets[i].pages) for i in call.layers],
                [call.pair],
                None if self.sums is None or not verify else [[self.sums[i]] for i in call.layers],
                0,
            )
            for call in self.calls
        ]
