"""Layer-wise parts: one request's KV sent as several frames so the receiver can start early.

A large payload is split into consecutive layer groups of at most
``max_part_bytes`` each (always at least one layer per part). Each part is a
complete, independently checksummed frame published under its own key, so a
waiting receiver verifies and injects part ``i`` while the sender is still
packing part ``i + 1``: the two copies overlap instead of adding up.

Part ``0`` travels under the caller's key and later parts under
``part_key(key, i)``; every part's metadata carries ``part_index``,
``num_parts`` and ``layer_start``. A payload that fits in one part is sent
unchanged (no part fields), so receivers of either kind interoperate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from vllm_omni_kv.errors import KVPayloadError, KVTransferTimeout
from vllm_omni_kv.wire.codec import LazyTensor
from vllm_omni_kv.wire.payload import KVCacheTransferData

PART_INDEX, NUM_PARTS, LAYER_START = "part_index", "num_parts", "layer_start"
T = TypeVar("T")
#: parts per payload are bounded so a corrupt header cannot make a receiver wait forever
MAX_PARTS = 4096


def part_key(key: str, index: int) -> str:
    """The connector key of part ``index`` (part 0 keeps ``key`` itself)."""
    return key if index == 0 else f"{key}.part{index}"


def _nbytes(t: Any) -> int:
    if t is None:
        return 0
    if isinstance(t, LazyTensor):
        return t.nbytes
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def _layer_lists(layer_blocks: Any) -> int | None:
    """The common per-layer list length, or None when the payload is not layer-indexed."""
    if not isinstance(layer_blocks, dict) or not layer_blocks:
        return None
    if not all(isinstance(v, list) for v in layer_blocks.values()):
        return None
    lengths = {len(v) for v in layer_blocks.values()}
    return lengths.pop() if len(lengths) == 1 else None


def split_payload(data: KVCacheTransferData, max_part_bytes: int) -> list[KVCacheTransferData]:
    """Split ``data`` into layer groups of at most ``max_part_bytes`` (no tensor bytes are copied).

    Returns ``[data]`` unchanged when splitting is disabled (``max_part_bytes <= 0``),
    the payload fits in one part, or its ``layer_blocks`` are not per-layer lists.
    """
    n_layers = _layer_lists(data.layer_blocks)
    if max_part_bytes <= 0 or not n_layers or n_layers < 2:
        return [data]
    sizes = [sum(_nbytes(v[i]) for v in data.layer_blocks.values()) for i in range(n_layers)]
    if sum(sizes) <= max_part_bytes:
        return [data]
    groups: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > max_part_bytes:
            groups.append((start, i))
            start, acc = i, 0
        acc += size
    groups.append((start, n_layers))
    parts = []
    for index, (lo, hi) in enumerate(groups):
        meta = {**data.metadata, PART_INDEX: index, NUM_PARTS: len(groups), LAYER_START: lo}
        blocks = {name: layers[lo:hi] for name, layers in data.layer_blocks.items()}
        ids = list(data.block_ids) if index == 0 else []
        parts.append(KVCacheTransferData(data.request_id, blocks, ids, meta))
    return parts


def part_info(obj: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(part_index, num_parts, layer_start)`` of a received part; None for a whole payload."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or (PART_INDEX not in meta and NUM_PARTS not in meta):
        return None
    index, num, start = meta.get(PART_INDEX), meta.get(NUM_PARTS), meta.get(LAYER_START)
    for name, value in ((PART_INDEX, index), (NUM_PARTS, num), (LAYER_START, start)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise KVPayloadError(
                f"KV part metadata field {name} must be an int >= 0, got {value!r}"
            )
    assert isinstance(index, int) and isinstance(num, int) and isinstance(start, int)
    if not 1 <= num <= MAX_PARTS or index >= num:
        raise KVPayloadError(
            f"KV part {index} of {num} is out of range (at most {MAX_PARTS} parts)"
        )
    return index, num, start


def part_layer_count(obj: dict[str, Any]) -> int:
    n = _layer_lists(obj.get("layer_blocks"))
    if not n:
        raise KVPayloadError("a KV part must carry per-layer lists in layer_blocks")
    return n


def _check_part(
    part: dict[str, Any], index: int, num: int, request_id: Any, layer: int, where: str = ""
) -> int:
    """Check that ``part`` is part ``index`` of ``num`` of ``request_id`` starting at ``layer``;
    return the layer the next part must start at."""
    info = part_info(part)
    if info is None or info[:2] != (index, num):
        raise KVPayloadError(f"{where}KV part {index} of {num} carries part metadata {info}")
    if part.get("request_id") != request_id:
        raise KVPayloadError(
            f"{where}KV part {index} of {num} belongs to request {part.get('request_id')!r}, "
            f"part 0 to {request_id!r}"
        )
    if info[2] != layer:
        raise KVPayloadError(
            f"{where}KV part {index} of {num} starts at layer {info[2]}, expected {layer}"
        )
    return layer + part_layer_count(part)


def join_parts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Reassemble received parts (in order) into one payload dict; tensors stay views."""
    if len(parts) == 1 and part_info(parts[0]) is None:
        return parts[0]
    first = parts[0]
    layer = 0
    layer_blocks: dict[str, list[Any]] = {}
    for i, p in enumerate(parts):
        if not isinstance(p, dict):
            raise KVPayloadError(f"KV part {i} is a {type(p).__name__}, not a payload mapping")
        layer = _check_part(p, i, len(parts), first.get("request_id"), layer)
        blocks = p["layer_blocks"]  # a mapping of per-layer lists (part_layer_count)
        layer_blocks = layer_blocks or {name: [] for name in blocks}
        if set(blocks) != set(layer_blocks):
            raise KVPayloadError(f"KV part {i} carries layer_blocks {sorted(blocks)}")
        for name, layers in blocks.items():
            layer_blocks[name].extend(layers)
    part_fields = (PART_INDEX, NUM_PARTS, LAYER_START)
    meta = {k: v for k, v in first["metadata"].items() if k not in part_fields}
    ids = first.get("block_ids")
    return {
        "request_id": first.get("request_id"),
        "layer_blocks": layer_blocks,
        "block_ids": list(ids) if isinstance(ids, list) else [],
        "metadata": meta,
    }


def send_parts(put: Callable[[str, Any], bool], key: str, data: Any, max_part_bytes: int) -> bool:
    """Send ``data`` under ``key`` as layer-wise parts through ``put(key, part)``; stop at a failure."""
    parts = split_payload(data, max_part_bytes) if isinstance(data, KVCacheTransferData) else [data]
    return all(put(part_key(key, i), part) for i, part in enumerate(parts))


def iter_parts(
    poll: Callable[[str, bool], tuple[T, int] | None],
    key: str,
    *,
    obj_of: Callable[[T], dict[str, Any]] = lambda item: item,  # type: ignore[assignment,return-value]
    discard: Callable[[T], None] = lambda item: None,
) -> Iterator[tuple[T, int]]:
    """Yield ``(part, size)`` for the payload under ``key`` as each part arrives.

    ``poll(key, first)`` returns ``(part, size)`` or None once its deadline has
    passed; ``obj_of(part)`` is the part's payload dict (parts may be streams),
    and ``discard(part)`` releases a part that fails its checks. Yields nothing
    when part 0 never arrives; raises ``KVTransferTimeout`` when a later part is
    missing (the sender stalled or died mid-payload) and ``KVPayloadError`` for
    parts that do not fit together.
    """
    got = poll(key, True)
    if got is None:
        return
    first, size = got
    try:
        head = obj_of(first)
        info = part_info(head)
        if info is not None and info[0] != 0:
            raise KVPayloadError(f"key {key!r} holds part {info[0]} instead of part 0")
        request_id = head.get("request_id")
        layer = 0 if info is None else info[2] + part_layer_count(head)
    except BaseException:
        discard(first)
        raise
    yield first, size
    if info is None:
        return
    num = info[1]
    for i in range(1, num):
        got = poll(part_key(key, i), False)
        if got is None:
            raise KVTransferTimeout(
                f"received {i} of {num} parts of {key!r}; part {i} did not arrive in time "
                "(the sender stalled or exited mid-payload)"
            )
        part, size = got
        try:
            layer = _check_part(obj_of(part), i, num, request_id, layer, f"{key!r}: ")
        except BaseException:
            discard(part)
            raise
        yield part, size
