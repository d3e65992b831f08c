"""The engine's KV cache groups as the connector sees them (vLLM's hybrid KV cache manager).

With HMA on, vLLM gives each KV cache group its own block table: full-attention
layers keep every block of a request, sliding-window (or chunked local) layers only
the blocks still inside their window, the others marked with the null block (id 0).
The connector moves, per group, the blocks the consumer's group keeps:

* scheduler (producer): a save names every transfer group's blocks, those before the
  group's window replaced by the null block (:func:`save_tables`), so the worker
  sends each layer only its group's kept blocks;
* scheduler (consumer): a load names every transfer group's blocks as vLLM allocated
  them (nulls before the window);
* worker: each registered layer belongs to one transfer group (:class:`LayerGroups`);
  payload and plan take that group's table, from its first kept block (a packed
  payload per layer; a shared-pages payload per group, :func:`shared_tables`).

A model with one group keeps the single-table path unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.formats import InjectionPlan, plan_injection
from vllm_omni_kv.kvcache.layer_windows import NULL_BLOCK, kept_from
from vllm_omni_kv.kvcache.paged_blocks import BlocksPlan, is_block_payload, plan_block_injection
from vllm_omni_kv.kvcache.shared_pages_plan import PageSource
from vllm_omni_kv.kvcache.shared_states import StatePage
from vllm_omni_kv.transfer.parts import part_info, part_layer_count

if TYPE_CHECKING:
    from vllm_omni_kv.connector.metadata import LoadSpec, SaveSpec
    from vllm_omni_kv.connector.receive import LayerCache


def transfer_tables(kv_cache_config: Any, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The block tables of the transfer groups, in order (every group when the
    config is unknown)."""
    select = getattr(kv_cache_config, "select_transfer_block_ids", None)
    groups = select(block_ids) if select is not None else block_ids
    return [[int(b) for b in g] for g in groups]


def main_group(kv_cache_config: Any) -> int:
    """The index (among transfer groups) of the first attention group: its table is a
    load's or save's ``block_ids`` (a state group's table is not per token)."""
    groups = getattr(kv_cache_config, "transfer_groups", None) or ()
    for i, g in enumerate(groups):
        if getattr(g.kv_cache_spec, "shapes", None) is None:
            return i
    return 0


def transfer_group_count(kv_cache_config: Any) -> int:
    """How many KV cache groups take part in transfers (1 without a config)."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return max(1, len(ids)) if ids is not None else 1


def _skipped_tokens(kv_cache_manager: Any, group_id: int, num_tokens: int) -> int:
    """Tokens before group ``group_id``'s attention window after ``num_tokens`` computed
    tokens, as vLLM's manager of that group counts them (0: it keeps every token)."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    if managers is None or group_id >= len(managers):
        return 0
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not isinstance(getattr(managers[group_id], "kv_cache_spec", None), AttentionSpec):
        return 0
    return max(0, int(managers[group_id].get_num_skipped_tokens(num_tokens)))


def save_tables(
    kv_cache_config: Any,
    kv_cache_manager: Any,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    block_size: int,
) -> list[list[int]]:
    """Producer: each transfer group's blocks holding ``num_tokens`` tokens, with those a
    consumer's group does not keep (before its window) replaced by the null block."""
    needed = -(-int(num_tokens) // block_size)
    tables = transfer_tables(kv_cache_config, block_ids)
    group_ids = getattr(kv_cache_config, "transfer_group_ids", range(len(tables)))
    out = []
    for group_id, table in zip(group_ids, tables, strict=True):
        skip = _skipped_tokens(kv_cache_manager, group_id, num_tokens) // block_size
        skip = min(skip, needed - 1)  # the last block is always kept
        out.append([NULL_BLOCK] * skip + table[skip:needed])
    return out


def kept_blocks(tables: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each table's blocks after its last null block (``remote_block_ids`` per group)."""
    return [list(t[kept_from(t, 0, len(t)) :]) for t in tables]


@dataclass(frozen=True)
class LayerGroups:
    """Which transfer group each registered layer belongs to."""

    by_layer: dict[str, int]
    num_groups: int

    @classmethod
    def of(cls, kv_cache_config: Any) -> LayerGroups:
        """From vLLM's ``KVCacheConfig`` (None: one group for every layer)."""
        by_layer = getattr(kv_cache_config, "transfer_group_index_by_layer", None)
        if not by_layer:
            return cls({}, 1)
        return cls(dict(by_layer), transfer_group_count(kv_cache_config))

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    def check_format(self, paged_blocks: bool) -> None:
        """``ConfigError`` for a hybrid model whose payloads would be token-major."""
        if self.hybrid and not paged_blocks:
            raise ConfigError(
                "this model has several KV cache groups (hybrid KV cache manager), which "
                "OmniKVConnector moves as paged blocks only: use equal producer and consumer "
                "TP sizes and transfer_format 'auto', or --disable-hybrid-kv-cache-manager"
            )

    def group(self, layer_name: str) -> int:
        """The transfer group of ``layer_name`` (0 for a model with one group)."""
        return self.by_layer.get(layer_name, 0) if self.hybrid else 0

    def transferred(self, layer_name: str) -> bool:
        """Whether ``layer_name`` takes part in transfers: with several groups, only the
        layers of a transfer group (a drafter's replica group may not be one)."""
        return not self.hybrid or layer_name in self.by_layer


def group_layers(layers: list[LayerCache], groups: LayerGroups) -> list[LayerCache]:
    """``layers`` that take part in transfers, each with its transfer group set."""
    out = [x for x in layers if groups.transferred(x.name)]
    for x in out:
        x.group = groups.group(x.name)
    return out


def payload_tables(spec: SaveSpec, layers: Sequence[LayerCache], block_size: int) -> dict[str, Any]:
    """Producer: the per-layer tables of a paged-blocks payload of ``spec`` (several
    groups: each layer its group's blocks from the first one kept); none for one group."""
    if spec.group_block_ids is None:
        return {}
    needed = -(-spec.num_tokens // block_size)
    ids, first = _layer_tables(spec.group_block_ids, [x.group for x in layers], 0, needed)
    return {"layer_ids": ids, "layer_first": first}


def _layer_tables(
    groups: Sequence[Sequence[int]], layer_groups: Sequence[int], start_block: int, needed: int
) -> tuple[list[list[int]], list[int]]:
    """Per layer: its group's table and the first block it keeps from ``start_block`` on
    (past the group's null blocks)."""
    ids = [list(groups[g]) for g in layer_groups]
    return ids, [kept_from(t, start_block, needed) for t in ids]


def plan_groups(
    part: dict[str, Any], layers: Sequence[LayerCache], spec: LoadSpec, extra: int = 0
) -> BlocksPlan:
    """The plan of a paged-blocks payload (or part) into a cache of several KV cache
    groups: each layer writes its group's blocks, from the first one it keeps. ``extra``:
    payload layers after ``layers`` that hold no pages (state layers, planned apart)."""
    if not is_block_payload(part):
        raise KVPayloadError(
            "a model with several KV cache groups loads paged-blocks payloads only (equal "
            "TP sizes, packed payloads): this payload is in another format"
        )
    info = part_info(part)
    first = 0 if info is None else info[2]
    local = [*layers, *[None] * extra][first : first + part_layer_count(part)]
    bs = layers[0].ident.block_size
    needed = -(-spec.num_prompt_tokens // bs)
    ids, starts = _layer_tables(
        spec.tables(),
        [layers[0].group if x is None else x.group for x in local],
        spec.num_local_tokens // bs,
        needed,
    )
    return plan_block_injection(
        part,
        [None if x is None else x.cache for x in local],
        spec.block_ids,
        layout=layers[0].ident,
        layer_ids=ids,
        layer_first=starts,
        layer_offset=first,
    )


def shared_tables(
    spec: SaveSpec, layers: Sequence[LayerCache]
) -> list[tuple[list[int], list[int]]] | None:
    """Producer: per transfer group, ``(its layers' payload indices, its table)`` for a
    shared-pages payload of ``spec`` (None for a model with one group)."""
    if spec.group_block_ids is None:
        return None
    by_group: dict[int, list[int]] = {}
    for i, x in enumerate(layers):
        by_group.setdefault(x.group, []).append(i)
    return [(idx, list(spec.group_block_ids[g])) for g, idx in sorted(by_group.items())]


def plan_shared(
    part: dict[str, Any],
    layers: Sequence[LayerCache],
    spec: LoadSpec,
    pages: PageSource | None,
    verify: bool,
    states: Sequence[StatePage] = (),
) -> InjectionPlan:
    """The plan of a shared-pages payload into a cache of several KV cache groups: each
    layer's pages are copied into its group's blocks, from the first one it keeps (and
    each of ``states``, a hybrid model's state layers, its state page)."""
    ident = layers[0].ident
    bs = ident.block_size
    ids, starts = _layer_tables(
        spec.tables(),
        [x.group for x in layers],
        spec.num_local_tokens // bs,
        -(-spec.num_prompt_tokens // bs),
    )
    return plan_injection(
        part,
        [x.cache for x in layers],
        spec.block_ids,
        start_token=spec.num_local_tokens,
        layout=ident,
        pages=pages,
        verify=verify,
        layer_ids=ids,
        layer_first=starts,
        states=states,
    )
