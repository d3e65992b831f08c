"""Build a request's ``KVCacheTransferData`` from paged KV caches, and apply one back.

Extraction is lazy by default: each layer becomes a :class:`codec.LazyTensor`
that gathers the request's blocks straight into the transport buffer when the
frame is packed, so the KV bytes are copied exactly once on the sending side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.blocks import gather_request_kv, request_kv_shape, scatter_request_kv
from vllm_omni_kv.transfer.codec import LazyTensor
from vllm_omni_kv.transfer.kv_utils import LayerKV, normalize_layer_kv
from vllm_omni_kv.transfer.payload import KVCacheTransferData
from vllm_omni_kv.transfer.stream import PayloadStream

logger = init_logger(__name__)

KEY, VALUE = "key_cache", "value_cache"


def _lazy_gather(blocks: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> LazyTensor:
    shape = request_kv_shape(blocks, seq_len)

    def fill(dst: torch.Tensor) -> None:
        gather_request_kv(blocks, block_ids, seq_len, out=dst)

    return LazyTensor(shape, blocks.dtype, fill, blocks.device)


def extract_request_kv(
    request_id: str,
    block_ids: Sequence[int],
    seq_len: int,
    kv_caches: Sequence[LayerKV | None],
    *,
    metadata: dict[str, Any] | None = None,
    lazy: bool = True,
    layout: str | None = None,
) -> KVCacheTransferData:
    """One request's KV as ``[seq_len, heads, dim]`` per layer (``None`` for absent layers).

    ``lazy=True`` defers the gather to packing time (one copy, straight into the
    transport buffer); ``lazy=False`` materialises the tensors now.
    """
    if seq_len <= 0:
        raise KVPayloadError(f"request {request_id}: seq_len must be positive, got {seq_len}")
    ids = [int(b) for b in block_ids]
    ids_t = torch.tensor(ids, dtype=torch.long)  # built once, shared by every layer
    keys: list[Any] = []
    values: list[Any] = []
    for idx, layer in enumerate(kv_caches):
        kv = (
            None
            if layer is None
            else normalize_layer_kv(layer, req_id=request_id, layer_idx=idx, layout=layout)
        )
        if kv is None:
            keys.append(None)
            values.append(None)
            continue
        k_blocks, v_blocks = kv
        if lazy:
            keys.append(_lazy_gather(k_blocks, ids_t, seq_len))
            values.append(_lazy_gather(v_blocks, ids_t, seq_len))
        else:
            keys.append(gather_request_kv(k_blocks, ids_t, seq_len))
            values.append(gather_request_kv(v_blocks, ids_t, seq_len))
    if all(k is None for k in keys):
        raise KVPayloadError(f"request {request_id}: no layer has a usable KV cache to extract")
    meta = {"seq_len": int(seq_len), "num_layers": len(keys), **(metadata or {})}
    return KVCacheTransferData(request_id, {KEY: keys, VALUE: values}, ids, meta)


def _kv_lists(data: dict[str, Any], n_layers: int) -> tuple[list[Any], list[Any]]:
    """The payload's per-layer key and value lists, checked against the local layer count."""
    blocks = data.get("layer_blocks", {})
    keys, values = blocks.get(KEY), blocks.get(VALUE)
    if not isinstance(keys, list) or not isinstance(values, list):
        raise KVPayloadError("payload layer_blocks lacks key_cache/value_cache lists")
    if len(keys) != n_layers or len(values) != n_layers:
        raise KVPayloadError(f"payload has {len(keys)} layers, the local model has {n_layers}")
    return keys, values


def inject_request_kv(
    data: dict[str, Any],
    kv_caches: Sequence[LayerKV | None],
    block_ids: Sequence[int],
    *,
    num_tokens: int | None = None,
    layout: str | None = None,
) -> int:
    """Write a received payload's first ``num_tokens`` tokens into paged blocks; return tokens written.

    Raises ``KVPayloadError`` when the payload does not fit the local cache
    (layer count, heads, head size, dtype or token count).
    """
    keys, values = _kv_lists(data, len(kv_caches))
    ids_t = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
    written = -1
    for idx, layer in enumerate(kv_caches):
        if layer is None:
            continue
        k_src, v_src = keys[idx], values[idx]
        if k_src is None or v_src is None:
            raise KVPayloadError(f"payload has no KV for layer {idx}, which the local model needs")
        kv = normalize_layer_kv(layer, layer_idx=idx, layout=layout)
        if kv is None:
            raise KVPayloadError(f"local KV cache of layer {idx} has an unsupported layout")
        n = k_src.shape[0] if num_tokens is None else num_tokens
        if n > k_src.shape[0] or n > v_src.shape[0]:
            raise KVPayloadError(
                f"layer {idx}: payload holds {k_src.shape[0]} tokens, {n} are needed"
            )
        for dst_blocks, src in ((kv[0], k_src), (kv[1], v_src)):
            if tuple(src.shape[1:]) != tuple(dst_blocks.shape[2:]) or src.dtype != dst_blocks.dtype:
                raise KVPayloadError(
                    f"layer {idx}: payload tensor {tuple(src.shape[1:])} {src.dtype} does not fit "
                    f"the local cache {tuple(dst_blocks.shape[2:])} {dst_blocks.dtype}"
                )
            if src.device != dst_blocks.device:
                src = src.to(dst_blocks.device)
            scatter_request_kv(dst_blocks, ids_t, src[:n])
        written = n
    return max(written, 0)


def inject_streamed_kv(
    stream: PayloadStream,
    kv_caches: Sequence[LayerKV | None],
    block_ids: Sequence[int],
    deadline: float,
    *,
    layout: str | None = None,
) -> int:
    """Like :func:`inject_request_kv` for a payload still arriving: each layer is
    written once its K and V bytes are final. The checksum is compared after the
    last layer; on any error the blocks may hold part of the payload."""
    keys, values = _kv_lists(stream.obj, len(kv_caches))

    def end(t: Any) -> int:
        if stream.frame_address is None or not isinstance(t, torch.Tensor):
            return 0
        return t.data_ptr() + t.numel() * t.element_size() - stream.frame_address

    order = sorted(
        (max(end(keys[i]), end(values[i])), i) for i, c in enumerate(kv_caches) if c is not None
    )
    written, done = -1, 0
    for ready in stream.ready(deadline):
        while done < len(order) and order[done][0] <= ready:
            i = order[done][1]
            one = {"layer_blocks": {KEY: [keys[i]], VALUE: [values[i]]}}
            n = inject_request_kv(one, [kv_caches[i]], block_ids, layout=layout)
            written = n if written < 0 else min(written, n)
            done += 1
    return max(written, 0)
