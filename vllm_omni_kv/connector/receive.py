"""The connector's view of its paged cache, and one request's load through the session.

A load checks every payload (part) against the request before a byte of it is
written: the prompt digest, token count and block size must match. Equal TP
sizes: the payload (or each layer-wise part) is planned into the request's
blocks and only the tokens the consumer lacks cross the transport. Different
TP sizes: every source shard is fetched whole, head shards are merged or
sliced, and the missing tokens are written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vllm_omni_kv.connector.metadata import LoadSpec
from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.formats import InjectionPlan, plan_injection
from vllm_omni_kv.kvcache.kv_utils import (
    KVTPTopology,
    LayerKV,
    detect_kv_layout,
    merge_received_rank_shards,
    normalize_layer_kv,
    slice_received_rank_shard,
)
from vllm_omni_kv.kvcache.meta import PayloadMeta
from vllm_omni_kv.kvcache.paged_blocks import blocks_to_tokens, is_block_payload
from vllm_omni_kv.kvcache.token_major import inject_request_kv
from vllm_omni_kv.transfer.parts import part_layer_count
from vllm_omni_kv.transfer.session import TransferSession
from vllm_omni_kv.wire.stream import PayloadStream, Span


@dataclass
class LayerCache:
    """One attention layer's paged cache as vLLM registered it."""

    name: str
    cache: LayerKV  # the registered tensor (or (key, value) tuple)
    layout: str
    key: torch.Tensor  # [num_blocks, block_size, heads, dim] view of the keys


def layer_caches(kv_caches: dict[str, Any], block_size: int) -> list[LayerCache]:
    """Check vLLM's per-layer caches; raise ``ConfigError`` for a layout we cannot read."""
    layers = []
    for i, (name, cache) in enumerate(kv_caches.items()):
        kv = normalize_layer_kv(cache, layer_idx=i)
        if kv is None:
            raise ConfigError(
                f"OmniKVConnector cannot read the KV cache layout of layer {name!r} "
                f"(shape {tuple(getattr(cache, 'shape', ()))}); supported: FlashAttention, "
                "FlashInfer, (key, value) tuples and vLLM's CPU layout"
            )
        if int(kv[0].shape[1]) != block_size:
            raise ConfigError(
                f"layer {name!r}: cache block size {kv[0].shape[1]} != configured "
                f"block_size {block_size}"
            )
        layers.append(LayerCache(name, cache, detect_kv_layout(cache), kv[0]))
    return layers


def check_payload(payload: dict[str, Any], spec: LoadSpec, block_size: int) -> None:
    """Refuse a payload (or part) that was not produced for this request and cache."""
    md = payload.get("metadata") if isinstance(payload, dict) else None
    if not isinstance(md, dict) or md.get("prompt_digest") != spec.prompt_digest:
        raise KVPayloadError(
            "payload was produced for a different prompt (token digest mismatch): send the "
            "consumer exactly the prompt the producer prefilled"
        )
    meta = PayloadMeta.of(payload)
    if meta.num_tokens != spec.num_prompt_tokens:
        raise KVPayloadError(
            f"payload holds {meta.num_tokens} tokens, the consumer's prompt has "
            f"{spec.num_prompt_tokens}"
        )
    if meta.block_size != block_size:
        raise KVPayloadError(
            f"payload was cut in blocks of {meta.block_size} tokens, this engine uses "
            f"{block_size}: producer and consumer must use the same block_size"
        )


class Received(NamedTuple):
    """What a load did: tokens written, bytes moved, seconds spent verifying and writing
    (the rest of a load is waiting for and opening the payload)."""

    tokens: int
    moved: int
    write_seconds: float


class _Timed:
    """An injection plan whose ``apply`` time is added to ``seconds[0]``."""

    def __init__(self, plan: InjectionPlan, seconds: list[float]) -> None:
        self.plan, self.seconds, self.tokens = plan, seconds, plan.tokens

    def spans(self, frame_address: int | None) -> list[Span] | None:
        return self.plan.spans(frame_address)

    def apply(
        self, stream: PayloadStream, deadline: float, cancel: threading.Event | None = None
    ) -> int:
        t0 = time.perf_counter()
        try:
            return self.plan.apply(stream, deadline, cancel)
        finally:
            self.seconds[0] += time.perf_counter() - t0


def receive(
    session: TransferSession,
    layers: Sequence[LayerCache],
    spec: LoadSpec,
    keys: Sequence[tuple[str, dict[str, Any] | None]],
    topo: KVTPTopology,
    deadline: float,
    cancel: threading.Event,
) -> Received:
    """Load tokens ``[num_local_tokens, num_prompt_tokens)`` of ``spec``."""
    caches = [x.cache for x in layers]
    write = [0.0]
    block_size = int(layers[0].key.shape[1]) if layers else 0
    start = spec.num_local_tokens
    if len(keys) == 1 and not topo.is_heterogeneous:
        key, endpoint = keys[0]

        def plan(part: dict[str, Any], layer_start: int) -> InjectionPlan:
            check_payload(part, spec, block_size)
            local = caches[layer_start : layer_start + part_layer_count(part)]
            return _Timed(plan_injection(part, local, spec.block_ids, start_token=start), write)

        _n, moved = session.receive_into(key, endpoint, deadline, plan, cancel)
        return Received(spec.num_load_tokens, moved, write[0])
    payloads, moved = [], 0
    for key, endpoint in keys:
        obj, n = session.fetch(key, endpoint, deadline, cancel)
        check_payload(obj, spec, block_size)
        payloads.append(blocks_to_tokens(obj) if is_block_payload(obj) else obj)
        moved += n
    merged = merge_received_rank_shards(payloads)
    if merged is not None and topo.target_tp_size > topo.source_tp_size:
        merged = slice_received_rank_shard(merged, topo)
    if merged is None:
        raise KVPayloadError("no payload after merging rank shards")
    t0 = time.perf_counter()
    inject_request_kv(
        merged, caches, spec.block_ids, start_token=start, num_tokens=spec.num_prompt_tokens
    )
    return Received(spec.num_load_tokens, moved, time.perf_counter() - t0)
