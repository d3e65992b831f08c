"""Per-layer block windows: which of a request's blocks each layer keeps.

Under vLLM's hybrid KV cache manager each KV cache group has its own block table,
and a group whose layers attend to a window (sliding window, chunked local
attention) holds only the blocks still inside it: the manager marks the others
with its null block (block id 0). A paged-blocks payload then carries, per layer,
only the blocks from its first kept block to the end of the request:
``metadata["layer_first_blocks"][i]`` is the payload block index of layer ``i``'s
first page (its tensor holds pages ``[first, num_blocks)``). Without that field
every layer holds every block, the single-table format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_omni_kv.errors import KVPayloadError

LAYER_FIRST_BLOCKS = "layer_first_blocks"
#: vLLM's null block: a placeholder for a block a group does not keep
NULL_BLOCK = 0

#: per layer: ``(block ids of its table, first block it keeps)``
Window = tuple[list[int], int]


def kept_from(ids: Sequence[int], start: int, needed: int) -> int:
    """The first of blocks ``[start, needed)`` of a table after its last null block in
    ``[0, needed)``: the blocks a layer with this table keeps start there."""
    last_null = max((i for i, b in enumerate(ids[:needed]) if int(b) == NULL_BLOCK), default=-1)
    return max(int(start), last_null + 1)


def layer_windows(
    block_ids: Sequence[int],
    needed: int,
    num_layers: int,
    layer_ids: Sequence[Sequence[int]] | None,
    layer_first: Sequence[int] | None,
) -> list[Window]:
    """Each layer's ``needed`` block ids and first kept block: ``layer_ids[i]`` and
    ``layer_first[i]`` where given, else ``block_ids`` from block 0 (one table).
    ``KVPayloadError`` when a table is short or a first block outside ``[0, needed)``."""
    out: list[Window] = []
    for i in range(num_layers):
        ids = [int(b) for b in (block_ids if layer_ids is None else layer_ids[i])][:needed]
        first = 0 if layer_first is None else int(layer_first[i])
        if len(ids) < needed:
            raise KVPayloadError(f"layer {i}: {needed} blocks needed, its table has {len(ids)}")
        if not 0 <= first < needed:
            raise KVPayloadError(f"layer {i}: first kept block {first} outside [0, {needed})")
        out.append((ids, first))
    return out


def first_blocks_field(windows: Sequence[Window]) -> dict[str, Any]:
    """The metadata field naming each layer's first payload block."""
    return {LAYER_FIRST_BLOCKS: [first for _ids, first in windows]}


#: the most layers a payload may declare (models have hundreds at most)
MAX_LAYERS = 1 << 16


def payload_first_blocks(md: dict[str, Any], num_layers: int, needed: int) -> list[int]:
    """Each payload layer's first block (all 0 for a single-table payload); checked."""
    if not 0 <= num_layers <= MAX_LAYERS:
        raise KVPayloadError(f"KV payload declares {num_layers} layers (at most {MAX_LAYERS})")
    raw = md.get(LAYER_FIRST_BLOCKS)
    if raw is None:
        return [0] * num_layers
    if (
        not isinstance(raw, list)
        or len(raw) != num_layers
        or not all(isinstance(f, int) and not isinstance(f, bool) and 0 <= f < needed for f in raw)
    ):
        raise KVPayloadError(
            f"KV payload field {LAYER_FIRST_BLOCKS} must list one block index in "
            f"[0, {needed}) per layer ({num_layers})"
        )
    return list(raw)


def check_window(layer: int, start: int, sent: int, needed: int, table: int) -> None:
    """``KVPayloadError`` unless a layer that needs blocks ``[start, needed)`` through a
    table of ``table`` blocks gets them from a payload holding blocks ``[sent, needed)``."""
    if start < sent or table < needed:
        raise KVPayloadError(
            f"layer {layer}: this cache needs its blocks from {start} of {needed}, the payload "
            f"holds them from {sent}: producer and consumer keep different windows "
            "(serve the same model with the same KV cache manager settings)"
        )
