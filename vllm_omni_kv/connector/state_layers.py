"""Recurrent-state layers (Mamba, gated delta net, short conv) of a hybrid model.

vLLM's hybrid KV cache manager gives these layers a ``MambaSpec`` group whose block
table holds the request's state: after ``T`` computed tokens, in block
``(T - 1) // block_size`` of that table (one block with ``mamba_cache_mode`` "none",
where the block size is the model length; the block of the last computed token in
"align" mode, vLLM's default with prefix caching). A state is not per token: it cannot
be trimmed to the tokens a consumer lacks, and vLLM recomputes a fully loaded
prompt's last token, which would apply it twice. So, as vLLM's NixlConnector does:

* the producer prefills all but the prompt's last token (:func:`truncate_for_save`)
  and its payload holds the attention pages of those ``N - 1`` tokens plus one state
  page per state layer, the state after them (packed: :func:`extract_payload`; a
  one-copy payload names the pages instead: :func:`state_sources`);
* the consumer loads those ``N - 1`` tokens (:func:`payload_tokens`) and computes the
  last one itself from the loaded state (:func:`plan_payload`, :func:`state_targets`).

The state's identity (shapes, dtypes, layer kind, conv state layout, mamba cache
dtypes) travels in the payload; a consumer whose identity differs refuses it and
recomputes. Heterogeneous TP is refused (the state would need resharding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_kv.connector.kv_groups import LayerGroups, payload_tables, plan_groups
from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId
from vllm_omni_kv.kvcache.device_staging import DeviceStager
from vllm_omni_kv.kvcache.layer_windows import NULL_BLOCK
from vllm_omni_kv.kvcache.paged_blocks import BlocksPlan, extract_request_blocks
from vllm_omni_kv.kvcache.shared_states import StatePage
from vllm_omni_kv.kvcache.state_pages import (
    STATE_LAYOUTS,
    STATE_PAGES,
    StateLayoutId,
    StatesPlan,
    gather_state,
    plan_states,
    state_pages,
)
from vllm_omni_kv.transfer.parts import part_info, part_layer_count
from vllm_omni_kv.wire.payload import KVCacheTransferData

if TYPE_CHECKING:
    from vllm_omni_kv.connector.metadata import LoadSpec, SaveSpec
    from vllm_omni_kv.connector.receive import LayerCache

#: per state layer name: its identity and its group's block size (tokens per block)
StateSpecs = Mapping[str, tuple[StateLayoutId, int]]


@dataclass
class StateLayer:
    """One state layer's cache as vLLM registered it."""

    name: str
    pages: torch.Tensor  # ``[blocks, C]`` uint8 view (C: the state's content bytes)
    ident: StateLayoutId
    block_size: int  # tokens per block of the layer's group table
    group: int = 0  # the layer's transfer group

    def block(self, table: Sequence[int], num_tokens: int) -> int:
        """The block of ``table`` holding the state after ``num_tokens`` tokens."""
        idx = (int(num_tokens) - 1) // self.block_size
        if num_tokens <= 0 or idx >= len(table) or int(table[idx]) == NULL_BLOCK:
            raise KVPayloadError(
                f"layer {self.name!r}: no state block for {num_tokens} tokens in its table "
                f"(block {idx} of {len(table)})"
            )
        return int(table[idx])


def _conv_layout() -> str:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        return str(get_conv_state_layout())
    except Exception:  # no vLLM (emulated engines)
        return ""


def state_specs(vllm_config: Any, kv_cache_config: Any) -> dict[str, tuple[StateLayoutId, int]]:
    """Per state layer of ``kv_cache_config`` (a ``MambaSpec``): its identity and block size;
    ``ConfigError`` for what the connector cannot move (speculative state blocks)."""
    cache = getattr(vllm_config, "cache_config", None)
    out: dict[str, tuple[StateLayoutId, int]] = {}
    layout = None
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        pairs = per_layer.items() if per_layer else ((n, spec) for n in group.layer_names)
        for name, s in pairs:
            if getattr(s, "shapes", None) is None or getattr(s, "dtypes", None) is None:
                continue  # attention
            if int(getattr(s, "num_speculative_blocks", 0) or 0):
                raise ConfigError(
                    f"layer {name!r}: OmniKVConnector does not move the speculative state "
                    "blocks of a Mamba layer; serve the hybrid model without speculative decoding"
                )
            layout = _conv_layout() if layout is None else layout
            kind = getattr(s, "mamba_type", "")
            out[name] = (
                StateLayoutId(
                    shapes=tuple(tuple(int(n) for n in shape) for shape in s.shapes),
                    dtypes=tuple(str(d).removeprefix("torch.") for d in s.dtypes),
                    kind=str(getattr(kind, "name", kind) or ""),
                    conv_layout=layout,
                    cache_dtype=str(getattr(cache, "mamba_cache_dtype", "auto")),
                    ssm_cache_dtype=str(getattr(cache, "mamba_ssm_cache_dtype", "auto")),
                ),
                int(s.block_size),
            )
    return out


def split_states(
    kv_caches: dict[str, Any], specs: StateSpecs, groups: LayerGroups
) -> tuple[dict[str, Any], list[StateLayer]]:
    """``kv_caches`` without its state layers, and those as :class:`StateLayer`\\ s."""
    rest = {n: c for n, c in kv_caches.items() if n not in specs}
    states = [
        StateLayer(n, state_pages(c, specs[n][0], n), specs[n][0], specs[n][1], groups.group(n))
        for n, c in kv_caches.items()
        if n in specs and groups.transferred(n)
    ]
    if states and not rest:
        raise ConfigError(
            "OmniKVConnector moves the recurrent state of hybrid models (attention plus "
            "Mamba / GDN / short-conv layers); this model has no attention layer"
        )
    return rest, states


def check_states_format(states: Sequence[StateLayer], paged_blocks: bool) -> None:
    """``ConfigError`` for state layers whose payloads would be token-major (different TP
    sizes): a recurrent state is sharded by heads and would need resharding."""
    if states and not paged_blocks:
        raise ConfigError(
            "this model keeps recurrent state (Mamba / GDN / short-conv layers), which "
            "OmniKVConnector moves between equal producer and consumer TP sizes only "
            "(transfer_format 'auto'): use the same TP size on both stages"
        )


def state_sources(states: Sequence[StateLayer], spec: SaveSpec) -> list[StatePage]:
    """Producer: each state layer's pages and the block holding ``spec``'s state (a
    one-copy payload names them)."""
    tables = spec.tables()
    return [StatePage(s.pages, s.ident, s.block(tables[s.group], spec.num_tokens)) for s in states]


def state_targets(states: Sequence[StateLayer], spec: LoadSpec) -> list[StatePage]:
    """Consumer: each state layer's pages and the block ``spec``'s loaded state goes to."""
    tables = spec.tables()
    return [
        StatePage(s.pages, s.ident, s.block(tables[s.group], spec.num_prompt_tokens))
        for s in states
    ]


def state_backoff(kv_cache_config: Any) -> int:
    """Prompt tokens the consumer computes itself: 1 for a model with state layers."""
    return 1 if bool(getattr(kv_cache_config, "has_mamba_layers", False)) else 0


def payload_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """The prompt tokens a consumer loads: all but the last ``backoff`` (none of a prompt
    that short: the consumer computes it)."""
    return max(0, num_prompt_tokens - backoff)


def truncate_for_save(request: Any, backoff: int) -> None:
    """Producer: drop the prompt's last ``backoff`` tokens before it is scheduled, so its
    state after the rest is what the payload carries; one token is generated (as vLLM's
    NixlConnector does). Once per request."""
    params = request.kv_transfer_params
    n = int(request.num_prompt_tokens)
    if not backoff or params is None or params.get("_omni_truncated") or n <= backoff:
        return
    if request.prompt_token_ids is None:
        return  # prompt embeddings: left whole, the consumer will refuse the payload
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens = n - backoff
    request.max_tokens = 1
    params["_omni_truncated"] = True


def _state_md(layers: Sequence[Any], states: Sequence[StateLayer]) -> dict[str, Any]:
    return {STATE_LAYOUTS: {str(len(layers) + i): s.ident.to_dict() for i, s in enumerate(states)}}


def extract_payload(
    spec: SaveSpec,
    layers: Sequence[LayerCache],
    states: Sequence[StateLayer],
    ident: KVLayoutId,
    metadata: dict[str, Any],
    stager: DeviceStager | None,
    block_size: int,
) -> KVCacheTransferData:
    """Producer: the paged-blocks payload of ``spec``: the attention layers' pages, then
    (payload layers after them) one state page per state layer."""
    tables = payload_tables(spec, layers, block_size)
    caches: list[torch.Tensor | None] = [x.cache for x in layers]
    if states:
        if not tables:
            raise KVPayloadError("a model with state layers sends per-group block tables")
        caches += [None] * len(states)
        tables["layer_ids"] += [tables["layer_ids"][0]] * len(states)
        tables["layer_first"] += [tables["layer_first"][0]] * len(states)
        metadata = {**metadata, **_state_md(layers, states)}
    data = extract_request_blocks(
        spec.transfer_id,
        spec.block_ids,
        spec.num_tokens,
        caches,
        layout=ident,
        metadata=metadata,
        stager=stager,
        **tables,
    )
    if states:
        group_tables = spec.tables()
        data.layer_blocks[STATE_PAGES] = [None] * len(layers) + [
            gather_state(s.pages, s.block(group_tables[s.group], spec.num_tokens)) for s in states
        ]
    return data


def plan_payload(
    part: dict[str, Any], layers: Sequence[LayerCache], states: Sequence[StateLayer], spec: LoadSpec
) -> BlocksPlan:
    """Consumer: the plan of a paged-blocks payload (or part) of several KV cache groups,
    its state pages included."""
    plan = plan_groups(part, layers, spec, extra=len(states))
    if not states:
        return plan
    info = part_info(part)
    first = 0 if info is None else info[2]
    tables = spec.tables()
    local: list[tuple[StateLayoutId, torch.Tensor, int] | None] = []
    for i in range(first, first + part_layer_count(part)):
        s = states[i - len(layers)] if i >= len(layers) else None
        if s is None:
            local.append(None)
        else:
            local.append((s.ident, s.pages, s.block(tables[s.group], spec.num_prompt_tokens)))
    return StatesPlan(plan, plan_states(part, local, first))
