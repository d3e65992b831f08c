"""Per-group block lists of a shared-pages payload (vLLM's hybrid KV cache manager).

With several KV cache groups each group has its own block table, and a group whose
layers attend to a window (sliding window, chunked local attention) keeps only the
blocks still inside it (:mod:`~vllm_omni_kv.kvcache.layer_windows`). A shared-pages
payload of such a model names, per group, its layers and the producer's blocks it
keeps: ``metadata["shared"]["groups"]`` is a list of
``{"layers": [payload layer indices], "first": f, "block_ids": [...]}`` where
``block_ids`` are the group's blocks for payload blocks ``[f, num_blocks)``. Every
layer is in exactly one group; the payload's top-level ``block_ids`` is empty (a reader
that does not know groups refuses the payload), and a layer's page digests (``sums``)
cover its group's blocks. A payload without ``groups`` is one group of every layer
from block 0 (the single-table format).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.layer_windows import MAX_LAYERS, check_window, kept_from

GROUPS = "groups"


@dataclass(frozen=True)
class PageGroup:
    """Payload layers sharing one block list: payload blocks ``[first, first + len(ids))``."""

    layers: list[int]
    first: int
    block_ids: list[int]


@dataclass(frozen=True)
class GroupCopy:
    """One copy call: payload layers ``layers``, ``(src, dst)`` page pairs, and the index
    in the group's block list (its digest rows) of the first pair."""

    layers: list[int]
    pairs: list[tuple[int, int]]
    first: int


def build_groups(
    tables: Sequence[tuple[Sequence[int], Sequence[int]]], needed: int, nblocks: int
) -> list[PageGroup]:
    """Producer: per ``(payload layer indices, group table)``, the blocks the group keeps
    of the first ``needed`` (from the first after its last null block)."""
    out = []
    for layers, table in tables:
        ids = [int(b) for b in table][:needed]
        first = kept_from(ids, 0, needed)
        kept = ids[first:]
        if len(ids) < needed or not kept or min(kept) < 0 or max(kept) >= nblocks:
            raise KVPayloadError(
                f"a group of layers {list(layers)[:4]}...: {needed} blocks in [0, {nblocks}) "
                f"needed, its table holds {ids[:8]}..."
            )
        out.append(PageGroup([int(i) for i in layers], first, kept))
    return out


def groups_field(groups: Sequence[PageGroup]) -> list[dict[str, Any]]:
    """The wire form of ``groups``."""
    return [{"layers": g.layers, "first": g.first, "block_ids": g.block_ids} for g in groups]


def _ints(v: Any, low: int, high: int | None = None) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= low and (high is None or x < high)
        for x in v
    )


def _group(i: int, g: Any, num_layers: int, num_blocks: int) -> PageGroup:
    what = f"shared-pages payload: group {i}"
    if not isinstance(g, dict) or set(g) != {"layers", "first", "block_ids"}:
        raise KVPayloadError(f"{what} must be a mapping of layers, first and block_ids")
    layers, first, ids = g["layers"], g["first"], g["block_ids"]
    if not layers or not _ints(layers, 0, num_layers):
        raise KVPayloadError(f"{what}: layers must be indices in [0, {num_layers})")
    if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < num_blocks:
        raise KVPayloadError(f"{what}: first block {first!r} outside [0, {num_blocks})")
    if not _ints(ids, 0) or len(ids) != num_blocks - first:
        raise KVPayloadError(
            f"{what}: {num_blocks - first} block ids >= 0 expected (blocks {first}.."
            f"{num_blocks - 1}), got {len(ids) if isinstance(ids, list) else ids!r}"
        )
    return PageGroup(list(layers), first, list(ids))


def parse_groups(
    shared: dict[str, Any], ids: list[Any], num_layers: int, num_blocks: int
) -> list[PageGroup]:
    """The payload's groups, checked (one group of every layer without the field):
    ``KVPayloadError`` naming what is wrong. ``ids``: the top-level block ids."""
    raw = shared.get(GROUPS)
    if raw is None:
        return [PageGroup(list(range(num_layers)), 0, list(ids))]
    if not isinstance(raw, list) or not 0 < len(raw) <= min(num_layers, MAX_LAYERS):
        raise KVPayloadError(
            f"shared-pages payload: groups must be a list of 1 to {num_layers} groups"
        )
    if ids:
        raise KVPayloadError("shared-pages payload with groups names no top-level block ids")
    groups = [_group(i, g, num_layers, num_blocks) for i, g in enumerate(raw)]
    seen = sorted(x for g in groups for x in g.layers)
    if seen != list(range(num_layers)):
        raise KVPayloadError(
            f"shared-pages payload: every one of its {num_layers} layers must be in exactly "
            "one group"
        )
    return groups


def check_sums(sums: Any, groups: Sequence[PageGroup], num_layers: int) -> None:
    """``KVPayloadError`` unless ``sums`` (when given) holds one digest per block of each
    layer's group."""
    if sums is None:
        return
    rows = {x: len(g.block_ids) for g in groups for x in g.layers}
    if (
        not isinstance(sums, list)
        or len(sums) != num_layers
        or any(not isinstance(s, list) or len(s) != rows[i] for i, s in enumerate(sums))
    ):
        raise KVPayloadError("shared-pages payload: page digests do not match its blocks")


def group_copies(
    groups: Sequence[PageGroup],
    block_ids: Sequence[int],
    first_block: int,
    needed: int,
    layer_ids: Sequence[Sequence[int]] | None = None,
    layer_first: Sequence[int] | None = None,
) -> list[GroupCopy]:
    """Consumer: the copies of ``groups`` into local tables. Each payload layer writes
    its local table (``layer_ids[i]``, else ``block_ids``) from its first block to write
    (``layer_first[i]``, else ``first_block``); layers of a group with the same table
    share one copy. ``KVPayloadError`` when a layer needs blocks the group does not hold."""
    out: list[GroupCopy] = []
    for g in groups:
        if layer_ids is None and layer_first is None:  # one local table: one copy
            check_window(g.layers[0], first_block, g.first, needed, len(block_ids))
            pairs = [
                (g.block_ids[k - g.first], int(block_ids[k])) for k in range(first_block, needed)
            ]
            out.append(GroupCopy(g.layers, pairs, first_block - g.first))
            continue
        by_table: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i in g.layers:
            table = [int(b) for b in (block_ids if layer_ids is None else layer_ids[i])]
            start = first_block if layer_first is None else int(layer_first[i])
            check_window(i, start, g.first, needed, len(table))
            by_table.setdefault((tuple(table[:needed]), start), []).append(i)
        for (table_t, start), layers in by_table.items():
            pairs = [(g.block_ids[k - g.first], table_t[k]) for k in range(start, needed)]
            out.append(GroupCopy(layers, pairs, start - g.first))
    return out


def local_firsts(tables: Sequence[Sequence[int]], start: int, needed: int) -> list[int]:
    """Per local layer table: the first block to write from ``start`` (past its nulls)."""
    return [kept_from(t, start, needed) for t in tables]
