"""The connector's view of its paged cache, and one request's load through the session.

A load checks every payload (part) against the request before a byte of it is
written: the prompt digest, token count and block size must match. Equal TP
sizes: the payload (or each layer-wise part) is planned into the request's
blocks and only the tokens the consumer lacks cross the transport. Different
TP sizes: every source shard is fetched whole, head shards are merged or
sliced, and the missing tokens are written.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vllm_omni_kv.connector.compat import COMPAT_KEY, CompatIdentity
from vllm_omni_kv.connector.engine_layout import EngineLayout
from vllm_omni_kv.connector.kv_groups import plan_shared
from vllm_omni_kv.connector.metadata import LoadSpec
from vllm_omni_kv.connector.state_layers import StateLayer, plan_payload, state_targets
from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId, block_kv
from vllm_omni_kv.kvcache.device_order import DeviceEvent, mark, streams_of
from vllm_omni_kv.kvcache.formats import InjectionPlan, plan_injection
from vllm_omni_kv.kvcache.kv_utils import (
    KVTPTopology,
    LayerKV,
    merge_received_rank_shards,
    slice_received_rank_shard,
)
from vllm_omni_kv.kvcache.meta import TOKEN_MAJOR, PayloadMeta
from vllm_omni_kv.kvcache.paged_blocks import blocks_to_tokens, is_block_payload
from vllm_omni_kv.kvcache.shared_pages import is_shared_payload
from vllm_omni_kv.kvcache.shared_pages_plan import SharedPagesPlan
from vllm_omni_kv.kvcache.token_major import inject_request_kv
from vllm_omni_kv.transfer.parts import part_info, part_layer_count
from vllm_omni_kv.transfer.session import TransferSession


@dataclass
class LayerCache:
    """One attention layer's paged cache as vLLM registered it."""

    name: str
    cache: torch.Tensor  # vLLM's 4-D view [kernel blocks, kv heads, kernel block size, C]
    ident: KVLayoutId
    #: K and V as ``[blocks, block_size, heads, head_size]`` views (token-major payloads);
    #: None where the layout cannot be viewed that way (MLA, or kernel blocks split a
    #: head-major block)
    kv: tuple[torch.Tensor, torch.Tensor] | None
    #: the layer's transfer group (hybrid KV cache manager; 0 for a single-group model)
    group: int = 0


def layer_caches(kv_caches: dict[str, Any], engine: EngineLayout) -> list[LayerCache]:
    """Check vLLM's per-layer caches against the engine's layout; ``ConfigError`` when one
    does not fit (or layers disagree)."""
    layers: list[LayerCache] = []
    for name, cache in kv_caches.items():
        ident = engine.identity(cache, name)
        if layers and ident != layers[0].ident:
            raise ConfigError(
                f"layer {name!r} ({ident.describe()}) differs from layer {layers[0].name!r} "
                f"({layers[0].ident.describe()}): OmniKVConnector needs one KV layout per engine"
            )
        layers.append(LayerCache(name, cache, ident, block_kv(cache, ident)))
    return layers


def token_caches(layers: Sequence[LayerCache]) -> list[LayerKV]:
    """The layers' ``(K, V)`` views for token-major payloads; ``KVPayloadError`` if absent."""
    out: list[LayerKV] = []
    for x in layers:
        if x.kv is None:
            raise KVPayloadError(
                f"this cache ({x.ident.describe()}) has no per-token K/V view, so token-major "
                "payloads (different TP sizes) cannot be written into it: run producer and "
                "consumer with the same TP size and block size"
            )
        out.append(x.kv)
    return out


def check_payload(
    payload: dict[str, Any], spec: LoadSpec, block_size: int, compat: CompatIdentity | None = None
) -> PayloadMeta:
    """Refuse a payload (or part) that was not produced for this request, model and cache;
    its metadata when it was."""
    md = payload.get("metadata") if isinstance(payload, dict) else None
    if not isinstance(md, dict) or md.get("prompt_digest") != spec.prompt_digest:
        raise KVPayloadError(
            "payload was produced for a different prompt (token digest mismatch): send the "
            "consumer exactly the prompt the producer prefilled"
        )
    diffs = compat.differences(md.get(COMPAT_KEY)) if compat is not None else []
    if diffs:
        raise KVPayloadError(
            "payload was produced by an incompatible engine, its KV would give wrong tokens "
            f"here: {'; '.join(diffs)}. Serve the same model (weights, tokenizer, dtype, "
            "KV cache dtype) with the same vLLM and vllm-omni-kv releases on both stages"
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
    return meta


class Received(NamedTuple):
    """What a load did: tokens written, bytes moved, seconds spent verifying and writing
    (the rest of a load is waiting for and opening the payload), and the payload's format
    (``shared_pages``: one copy, ``paged_blocks``: packed pages, ``token_major``)."""

    tokens: int
    moved: int
    write_seconds: float
    format: str


@contextlib.contextmanager
def device_writes(device: torch.device | None, after: DeviceEvent | None = None) -> Iterator[None]:
    """Run a load's writes into a device cache on this thread's side stream, and wait for
    them before returning: a load is reported (and vLLM's forward reads the blocks)
    only after its bytes are on the device. ``after``: an event recorded on the forward
    stream when the load was started; the writes run after it, so work queued there
    before (a step still running, async scheduling) never lands on a block after the
    load. A no-op for host caches."""
    streams = streams_of(device)
    if device is None or streams is None:
        yield
        return
    streams.set_device(device)  # this TP rank's device, in every load thread
    stream = streams.side(device)
    try:
        with streams.use(stream):
            if after is not None:
                stream.wait_event(after)
            yield
    finally:
        stream.synchronize()


def forward_mark(layers: Sequence[LayerCache]) -> DeviceEvent | None:
    """An event after the work queued so far on the forward stream of ``layers``' device
    (recorded by the thread that starts the loads); None for a host cache."""
    device = layers[0].cache.device if layers else None
    streams = streams_of(device)
    if device is None or streams is None:
        return None
    return mark(streams, device)


def _plan(
    part: dict[str, Any],
    layers: Sequence[LayerCache],
    spec: LoadSpec,
    session: TransferSession,
    states: Sequence[StateLayer] = (),
) -> InjectionPlan:
    """The injection plan of one received payload (or layer-wise part) into ``layers``
    (and ``states``, the state layers of a hybrid model)."""
    ident = layers[0].ident
    start = spec.num_local_tokens
    if spec.group_block_ids is not None:
        if is_shared_payload(part):  # each group's pages (and state pages), copied
            region, verify = session.cache_region, session.verifies_frames
            return plan_shared(part, layers, spec, region, verify, state_targets(states, spec))
        return plan_payload(part, layers, states, spec)
    if is_shared_payload(part):  # the pages are copied from the producer's cache
        caches: list[Any] = [x.cache for x in layers]
        return plan_injection(
            part,
            caches,
            spec.block_ids,
            start_token=start,
            layout=ident,
            pages=session.cache_region,
            verify=session.verifies_frames,
        )
    info = part_info(part)
    first = 0 if info is None else info[2]
    blocks = is_block_payload(part)
    source: list[Any] = [x.cache for x in layers] if blocks else token_caches(layers)
    local = source[first : first + part_layer_count(part)]
    return plan_injection(
        part, local, spec.block_ids, start_token=start, layout=ident if blocks else None
    )


def receive(
    session: TransferSession,
    layers: Sequence[LayerCache],
    spec: LoadSpec,
    keys: Sequence[tuple[str, dict[str, Any] | None]],
    topo: KVTPTopology,
    deadline: float,
    cancel: threading.Event,
    compat: CompatIdentity | None = None,
    after: DeviceEvent | None = None,
    states: Sequence[StateLayer] = (),
) -> Received:
    """Load tokens ``[num_local_tokens, num_prompt_tokens)`` of ``spec`` (and the state of
    ``states`` after them); every payload
    must carry ``compat`` (this engine's compatibility identity) when it is given, and
    the writes run after ``after`` (:func:`forward_mark` of when the load started).
    One descent: the session hands out each payload's stream, kvcache plans where its
    bytes go (blocks, tokens, or pages copied from the producer's cache), and the plan
    is applied here."""
    with device_writes(layers[0].cache.device if layers else None, after):
        block_size = layers[0].ident.block_size if layers else 0
        if len(keys) == 1 and not topo.is_heterogeneous:
            key, endpoint = keys[0]
            moved, write, fmt = 0, 0.0, ""
            for stream in session.open_parts(key, endpoint, deadline, cancel):
                with stream:
                    part = stream.obj
                    fmt = check_payload(part, spec, block_size, compat).format
                    plan = _plan(part, layers, spec, session, states)
                    t0 = time.perf_counter()
                    plan.apply(stream, deadline, cancel)
                    write += time.perf_counter() - t0
                    moved += stream.moved + (plan.moved if isinstance(plan, SharedPagesPlan) else 0)
            return Received(spec.num_load_tokens, moved, write, fmt)
        return _receive_shards(session, layers, spec, keys, topo, deadline, cancel, compat)


def _receive_shards(
    session: TransferSession,
    layers: Sequence[LayerCache],
    spec: LoadSpec,
    keys: Sequence[tuple[str, dict[str, Any] | None]],
    topo: KVTPTopology,
    deadline: float,
    cancel: threading.Event,
    compat: CompatIdentity | None,
) -> Received:
    """Heterogeneous TP: every source rank's payload, merged or sliced token-major."""
    block_size = layers[0].ident.block_size if layers else 0
    if spec.group_block_ids is not None:
        raise KVPayloadError(
            "a model with several KV cache groups needs equal producer and consumer TP "
            "sizes (or --disable-hybrid-kv-cache-manager on both)"
        )
    payloads, moved = [], 0
    for key, endpoint in keys:
        obj, n = session.fetch(key, endpoint, deadline, cancel)
        check_payload(obj, spec, block_size, compat)
        if is_shared_payload(obj):
            raise KVPayloadError(
                "a shared-pages payload needs equal producer and consumer TP sizes"
            )
        payloads.append(blocks_to_tokens(obj) if is_block_payload(obj) else obj)
        moved += n
    merged = merge_received_rank_shards(payloads)
    if merged is not None and topo.target_tp_size > topo.source_tp_size:
        merged = slice_received_rank_shard(merged, topo)
    if merged is None:
        raise KVPayloadError("no payload after merging rank shards")
    t0 = time.perf_counter()
    inject_request_kv(
        merged,
        token_caches(layers),
        spec.block_ids,
        start_token=spec.num_local_tokens,
        num_tokens=spec.num_prompt_tokens,
    )
    return Received(spec.num_load_tokens, moved, time.perf_counter() - t0, TOKEN_MAJOR)
