"""The token-major payload format: ``[rows, heads, head_dim]`` K and V per layer.

Used between caches of different layouts or TP sizes (head shards are merged or
sliced per token) and by vLLM-free stages that want plain tensors. Extraction is
lazy by default: each layer becomes a :class:`~vllm_omni_kv.wire.codec.LazyTensor`
that gathers the request's blocks straight into the transport buffer when the
frame is packed (one copy on the sending side). A receiver plans which rows go
to which local blocks (:func:`plan_token_injection`); the plan names the frame
byte spans it needs, so a consumer holding a prefix loads only the rest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import bits
from vllm_omni_kv.kvcache.device_order import streams_of
from vllm_omni_kv.kvcache.device_scratch import thread_scratch
from vllm_omni_kv.kvcache.device_staging import DeviceStager, Part, StagedPages, layer_callbacks
from vllm_omni_kv.kvcache.kv_utils import LayerKV, normalize_layer_kv
from vllm_omni_kv.kvcache.meta import TOKEN_MAJOR, PayloadMeta
from vllm_omni_kv.kvcache.request_blocks import (
    gather_request_kv,
    request_kv_shape,
    scatter_checked,
    scatter_request_kv,
)
from vllm_omni_kv.wire.codec import LazyTensor
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import PayloadStream, Span

KEY, VALUE = "key_cache", "value_cache"


def _lazy_gather(
    blocks: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    staged: StagedPages | None,
    index: int,
) -> LazyTensor:
    shape = request_kv_shape(blocks, seq_len)

    def fill(dst: torch.Tensor) -> Iterator[int]:
        if dst.device == blocks.device:
            gather_request_kv(blocks, block_ids, seq_len, out=dst)
        else:  # a GPU cache into host memory: gather on the device, then one copy
            dst.copy_(gather_request_kv(blocks, block_ids.to(blocks.device), seq_len))
        yield dst.numel() * dst.element_size()

    fill_, place = layer_callbacks(staged, index, fill)
    return LazyTensor(shape, blocks.dtype, fill_, blocks.device, place)


def _staged(
    stager: DeviceStager | None,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    ids: list[int],
    seq_len: int,
) -> StagedPages | None:
    """Every layer's K rows, then every layer's V rows (the frame's order), staged at once;
    None without a stager for these caches' device."""
    first = next((kv[0] for kv in pairs if kv is not None), None)
    if stager is None or first is None or stager.device != first.device:
        return None
    bs, nblocks = int(first.shape[1]), int(first.shape[0])
    needed = -(-seq_len // bs)
    used = ids[:needed]
    if len(used) < needed or min(used) < 0 or max(used) >= nblocks:
        raise KVPayloadError(
            f"{seq_len} tokens need {needed} block ids in [0, {nblocks}), got {ids[: needed + 1]}"
        )
    parts: list[Part | None] = [None] * (2 * len(pairs))
    for i, kv in enumerate(pairs):
        for j, blocks in enumerate(kv or ()):
            rows = (seq_len, *request_kv_shape(blocks, seq_len)[1:])
            parts[j * len(pairs) + i] = (rows, blocks.dtype, _token_rows(blocks, seq_len, used[-1]))
    return stager.stage(parts, used)


def _token_rows(
    blocks: torch.Tensor, seq_len: int, last: int
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Gather of the first ``seq_len`` token rows of the blocks ``idx`` names (full blocks
    with one ``index_select``, the tail of block ``last`` with one copy): no host wait."""
    bs, h, d = (int(x) for x in blocks.shape[1:])
    full, tail = divmod(seq_len, bs)

    def run(idx: torch.Tensor, out: torch.Tensor) -> None:
        src, dst = bits(blocks), bits(out)
        if full:
            torch.index_select(src, 0, idx[:full], out=dst[: full * bs].view(full, bs, h, d))
        if tail:
            dst[full * bs :].copy_(src[last][:tail])

    return run


def extract_request_kv(
    request_id: str,
    block_ids: Sequence[int],
    seq_len: int,
    kv_caches: Sequence[LayerKV | None],
    *,
    metadata: dict[str, Any] | None = None,
    lazy: bool = True,
    layout: str | None = None,
    stager: DeviceStager | None = None,
) -> KVCacheTransferData:
    """One request's KV as ``[seq_len, heads, dim]`` per layer (``None`` for absent layers).

    ``lazy=True`` defers the gather to packing time (one copy, straight into the
    transport buffer); ``lazy=False`` materialises the tensors now. With ``stager`` (a
    cache on its device) every layer's K and V rows are gathered at once into its staging
    buffer (block ids uploaded once, no host wait) and packing copies them out of it.
    """
    if seq_len <= 0:
        raise KVPayloadError(f"request {request_id}: seq_len must be positive, got {seq_len}")
    ids = [int(b) for b in block_ids]
    ids_t = torch.tensor(ids, dtype=torch.long)  # built once, shared by every layer
    pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [
        None
        if layer is None
        else normalize_layer_kv(layer, req_id=request_id, layer_idx=idx, layout=layout)
        for idx, layer in enumerate(kv_caches)
    ]
    first = next((kv[0] for kv in pairs if kv is not None), None)
    if first is None:
        raise KVPayloadError(f"request {request_id}: no layer has a usable KV cache to extract")
    block_size = int(first.shape[1])
    staged = _staged(stager, pairs, ids, seq_len) if lazy else None
    keys: list[Any] = []
    values: list[Any] = []
    for i, kv in enumerate(pairs):
        for j, (out, blocks) in enumerate(zip((keys, values), kv or (None, None), strict=True)):
            if blocks is None:
                out.append(None)
            elif lazy:
                out.append(_lazy_gather(blocks, ids_t, seq_len, staged, j * len(pairs) + i))
            else:
                out.append(gather_request_kv(blocks, ids_t, seq_len))
    meta = PayloadMeta(TOKEN_MAJOR, int(seq_len), block_size, int(seq_len), len(keys))
    md = {"seq_len": int(seq_len), **meta.to_dict(**(metadata or {}))}
    return KVCacheTransferData(request_id, {KEY: keys, VALUE: values}, ids, md)


def kv_lists(data: dict[str, Any], n_layers: int) -> tuple[list[Any], list[Any]]:
    """The payload's per-layer key and value lists, checked against the local layer count."""
    blocks = data.get("layer_blocks")
    keys = blocks.get(KEY) if isinstance(blocks, dict) else None
    values = blocks.get(VALUE) if isinstance(blocks, dict) else None
    if not isinstance(keys, list) or not isinstance(values, list):
        raise KVPayloadError("payload layer_blocks lacks key_cache/value_cache lists")
    if len(keys) != n_layers or len(values) != n_layers:
        raise KVPayloadError(f"payload has {len(keys)} layers, the local model has {n_layers}")
    return keys, values


def _span(t: torch.Tensor, frame_address: int) -> Span:
    start = t.data_ptr() - frame_address
    return start, start + t.numel() * t.element_size()


@dataclass
class _Copy:
    key: torch.Tensor  # payload rows to write (views of the frame)
    value: torch.Tensor
    k_blocks: torch.Tensor  # local ``[num_blocks, block_size, heads, dim]`` views
    v_blocks: torch.Tensor
    ids: list[int]  # local block ids, starting with the block of the first row


class TokensPlan:
    """Which payload rows go to which local blocks; built by :func:`plan_token_injection`."""

    def __init__(self, tokens: int, copies: list[_Copy]) -> None:
        self.tokens = tokens
        self.copies = copies

    def spans(self, frame_address: int | None) -> list[Span] | None:
        """The frame bytes the plan reads (None: the whole frame)."""
        if frame_address is None:
            return None
        spans = []
        for c in self.copies:
            spans += [_span(c.key, frame_address), _span(c.value, frame_address)]
        spans.sort()
        return spans

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        """Write each layer once its K and V rows are final; return the payload's token count."""
        fa = stream.frame_address
        order = sorted(
            (0 if fa is None else max(_span(c.key, fa)[1], _span(c.value, fa)[1]), i)
            for i, c in enumerate(self.copies)
        )
        done = 0
        with self._writer() as write:
            for ready in stream.load(self.spans(fa), deadline, cancel):
                while done < len(order) and order[done][0] <= ready:
                    write(self.copies[order[done][1]])
                    done += 1
            if done < len(order):
                raise KVPayloadError(
                    f"the stream ended with {len(order) - done} layers not written"
                )
        return self.tokens

    def write_all(self) -> int:
        """Write every planned layer now (a payload that is complete and verified)."""
        with self._writer() as write:
            for c in self.copies:
                write(c)
        return self.tokens

    @contextlib.contextmanager
    def _writer(self) -> Iterator[Callable[[_Copy], None]]:
        """The layer writer of one move. Into a device cache: block ids checked on the host
        and uploaded once, no host wait per layer, one when the move ends (the frame may be
        released after it)."""
        device = self.copies[0].k_blocks.device if self.copies else None
        streams = streams_of(device)
        if device is None or streams is None:
            yield self._write
            return
        ids = [_checked_ids(c) for c in self.copies]
        with thread_scratch(device, streams).use() as scratch:
            flat = scratch.ids([b for one in ids for b in one])
            at, mine = 0, {}
            for c, one in zip(self.copies, ids, strict=True):
                mine[id(c)] = (flat[at : at + len(one)], one[-1] if one else 0)
                at += len(one)

            def write(c: _Copy) -> None:
                dev_ids, tail = mine[id(c)]
                scatter_checked(c.k_blocks, dev_ids, tail, c.key)
                scatter_checked(c.v_blocks, dev_ids, tail, c.value)

            try:
                yield write
            finally:  # also on an error: nothing still reads the frame when it goes
                streams.current(device).synchronize()

    @staticmethod
    def _write(c: _Copy) -> None:
        scatter_request_kv(c.k_blocks, c.ids, c.key)
        scatter_request_kv(c.v_blocks, c.ids, c.value)


def _checked_ids(c: _Copy) -> list[int]:
    """The local blocks ``c``'s rows go to: distinct and in range (``KVPayloadError``)."""
    bs, nblocks = int(c.k_blocks.shape[1]), int(c.k_blocks.shape[0])
    needed = -(-int(c.key.shape[0]) // bs)
    ids = [int(b) for b in c.ids[:needed]]
    if len(ids) < needed:
        raise KVPayloadError(f"{c.key.shape[0]} rows need {needed} blocks, {len(ids)} given")
    if ids and (min(ids) < 0 or max(ids) >= nblocks):
        raise KVPayloadError(f"block id out of range [0, {nblocks}): {min(ids)}..{max(ids)}")
    if len(set(ids)) != len(ids):
        raise KVPayloadError("block_ids used for one request must be distinct")
    return ids


def plan_token_injection(
    data: dict[str, Any],
    kv_caches: Sequence[LayerKV | None],
    block_ids: Sequence[int],
    *,
    start_token: int = 0,
    num_tokens: int | None = None,
    layout: str | None = None,
) -> TokensPlan:
    """Check a token-major payload against the local cache (header only, no bytes read).

    Rows ``[start_token, end)`` go to the local blocks from ``block_ids[start_token //
    block_size]`` on, where ``end`` is ``num_tokens`` (default: the payload's). The
    first ``start_token`` tokens are held locally; ``start_token`` must be a multiple
    of the local block size. Raises ``KVPayloadError`` when layer count, heads,
    head size, dtype or token count do not fit.
    """
    meta = PayloadMeta.of(data)
    if meta.format != TOKEN_MAJOR:
        raise KVPayloadError(f"not a token-major payload (format {meta.format!r})")
    keys, values = kv_lists(data, len(kv_caches))
    end = meta.num_tokens if num_tokens is None else num_tokens
    copies = []
    for idx, layer in enumerate(kv_caches):
        if layer is None:
            continue
        k_src, v_src = keys[idx], values[idx]
        if not isinstance(k_src, torch.Tensor) or not isinstance(v_src, torch.Tensor):
            raise KVPayloadError(f"payload has no KV for layer {idx}, which the local model needs")
        kv = normalize_layer_kv(layer, layer_idx=idx, layout=layout)
        if kv is None:
            raise KVPayloadError(f"local KV cache of layer {idx} has an unsupported layout")
        bs = int(kv[0].shape[1])
        if start_token % bs or not 0 <= start_token <= end:
            raise KVPayloadError(f"cannot load tokens [{start_token}, {end}) in blocks of {bs}")
        for blocks, src in ((kv[0], k_src), (kv[1], v_src)):
            if src.dim() != 3 or src.shape[0] < end:
                raise KVPayloadError(
                    f"layer {idx}: payload holds {tuple(src.shape)}, {end} token rows are needed"
                )
            if tuple(src.shape[1:]) != tuple(blocks.shape[2:]) or src.dtype != blocks.dtype:
                raise KVPayloadError(
                    f"layer {idx}: payload tensor {tuple(src.shape[1:])} {src.dtype} does not fit "
                    f"the local cache {tuple(blocks.shape[2:])} {blocks.dtype}"
                )
        if end > start_token:
            ids = [int(b) for b in block_ids][start_token // bs :]
            copies.append(_Copy(k_src[start_token:end], v_src[start_token:end], kv[0], kv[1], ids))
    return TokensPlan(end, copies)


def inject_request_kv(
    data: dict[str, Any],
    kv_caches: Sequence[LayerKV | None],
    block_ids: Sequence[int],
    *,
    num_tokens: int | None = None,
    start_token: int = 0,
    layout: str | None = None,
) -> int:
    """Write a complete payload's tokens ``[start_token, num_tokens)`` into paged blocks.

    Returns the token count; raises ``KVPayloadError`` when the payload does not fit.
    """
    plan = plan_token_injection(
        data, kv_caches, block_ids, start_token=start_token, num_tokens=num_tokens, layout=layout
    )
    return plan.write_all()


def map_layer_tensors(data: dict[str, Any], fn: Any) -> dict[str, Any]:
    """``data`` with ``fn`` applied to every tensor of its per-layer lists."""
    given = data.get("layer_blocks")
    blocks = {
        name: [fn(t) if isinstance(t, torch.Tensor) else t for t in layers]
        if isinstance(layers, list)
        else layers
        for name, layers in (given.items() if isinstance(given, dict) else ())
    }
    return {**data, "layer_blocks": blocks}


def trim_to_num_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """Keep the first ``metadata.num_tokens`` rows of each tensor (views)."""
    md = data.get("metadata")
    n = md.get("num_tokens") if isinstance(md, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return data
    return map_layer_tensors(data, lambda t: t[:n] if t.dim() and t.shape[0] > n else t)


def to_device(data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``data`` with every layer tensor moved to ``device``."""
    return map_layer_tensors(data, lambda t: t.to(device))
