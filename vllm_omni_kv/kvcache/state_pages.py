"""Recurrent-state pages: the per-request state of Mamba, gated-delta-net and short-conv
layers, as vLLM's hybrid KV cache manager keeps it.

vLLM 0.32 registers such a layer as a ``[blocks, 1, 1, C]`` int8 view: block ``b``'s
first ``C`` bytes hold the layer's states back to back (conv state, then SSM / GDN
state; :class:`StateLayoutId` names their shapes and dtypes), the rest of the block is
padding. A request keeps its state after ``T`` computed tokens in one block (its
group's block ``(T - 1) // block_size``), so a payload carries one state page per
state layer: ``layer_blocks["state_pages"][i]`` is ``[1, C]`` uint8 for a state layer
``i`` (None for an attention layer), and ``metadata["state_layouts"]`` lists each state
layer's identity. A receiver writes the page byte for byte into its own state block
after checking the identities are equal (:func:`plan_states`); :class:`StatesPlan`
runs those copies with a paged-blocks plan of the same payload (part).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.page_gather import addressable, iter_gather_pages
from vllm_omni_kv.kvcache.paged_blocks import BlocksPlan
from vllm_omni_kv.wire.codec import LazyTensor
from vllm_omni_kv.wire.stream import Span, merge_spans

STATE_PAGES = "state_pages"
STATE_LAYOUTS = "state_layouts"

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class StateLayoutId:
    """What one state layer's page holds: the states' shapes and dtypes (in page order),
    the layer kind (vLLM's ``mamba_type``), the conv state layout (``"DS"``: dim
    first, ``"SD"``: state length first) and the engine's mamba cache dtypes."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    kind: str = ""
    conv_layout: str = ""
    cache_dtype: str = "auto"  # ``mamba_cache_dtype``
    ssm_cache_dtype: str = "auto"  # ``mamba_ssm_cache_dtype``

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ConfigError(f"state layout {self.describe()}: one dtype per state shape")
        unknown = [d for d in self.dtypes if d not in _DTYPE_BYTES]
        if unknown:
            raise ConfigError(f"state layout {self.describe()}: unknown dtypes {unknown}")

    @property
    def content_bytes(self) -> int:
        """Bytes of one state page (every state, no padding)."""
        return sum(
            math.prod(s) * _DTYPE_BYTES[d] for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    def describe(self) -> str:
        states = ", ".join(f"{list(s)} {d}" for s, d in zip(self.shapes, self.dtypes, strict=False))
        return (
            f"{self.kind or 'state'} [{states}], conv layout {self.conv_layout or '?'}, "
            f"mamba_cache_dtype {self.cache_dtype}, mamba_ssm_cache_dtype {self.ssm_cache_dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "kind": self.kind,
            "conv_layout": self.conv_layout,
            "cache_dtype": self.cache_dtype,
            "ssm_cache_dtype": self.ssm_cache_dtype,
        }

    @classmethod
    def of(cls, raw: Any) -> StateLayoutId:
        """The identity a payload declares; ``KVPayloadError`` when it is malformed."""
        try:
            if not isinstance(raw, dict):
                raise TypeError("not a mapping")
            shapes = tuple(tuple(int(n) for n in s) for s in raw["shapes"])
            dtypes = tuple(str(d) for d in raw["dtypes"])
            fields = ("kind", "conv_layout", "cache_dtype", "ssm_cache_dtype")
            return cls(shapes, dtypes, *(str(raw.get(k, "")) for k in fields))
        except (TypeError, KeyError, ValueError, ConfigError) as e:
            raise KVPayloadError(f"KV payload state layout {raw!r} is malformed: {e}") from e


def check_declared_state(declared: dict[str, Any], index: int, ident: StateLayoutId) -> None:
    """``KVPayloadError`` unless the identity a payload's ``state_layouts`` (``declared``)
    gives payload layer ``index`` is ``ident``, this engine's (or is malformed)."""
    theirs = StateLayoutId.of(declared.get(str(index)))
    if theirs != ident:
        raise KVPayloadError(
            f"layer {index}: the payload's state ({theirs.describe()}) differs from this "
            f"engine's ({ident.describe()}); serve both stages with the same model, dtype, "
            "mamba cache dtypes and conv state layout"
        )


def state_pages(cache: Any, ident: StateLayoutId, name: str = "state layer") -> torch.Tensor:
    """The ``[blocks, C]`` uint8 view of a state layer's registered cache (``C``: the
    page's content bytes); ``ConfigError`` when the view is not vLLM's ``[B, 1, 1, C]``."""
    want = ident.content_bytes
    if (
        not isinstance(cache, torch.Tensor)
        or cache.dim() != 4
        or tuple(cache.shape[1:3]) != (1, 1)
        or cache.element_size() != 1
        or int(cache.shape[3]) < want
        or cache.stride(3) != 1
    ):
        got = tuple(getattr(cache, "shape", ())) or type(cache).__name__
        raise ConfigError(
            f"layer {name!r}: OmniKVConnector moves a state layer as vLLM 0.32's [blocks, 1, 1, "
            f"{want}] int8 page view of {ident.describe()}, got {got}"
        )
    return cache[:, 0, 0, :want].view(torch.uint8)


def gather_state(pages: torch.Tensor, block: int) -> LazyTensor:
    """Block ``block``'s state page, gathered at pack time into the frame."""
    if not 0 <= block < int(pages.shape[0]):
        raise KVPayloadError(f"state block {block} outside [0, {int(pages.shape[0])})")
    fill = functools.partial(iter_gather_pages, pages, [block])
    return LazyTensor((1, int(pages.shape[1])), torch.uint8, fill, pages.device)


@dataclass
class StateCopy:
    """One state page of a payload and where it goes."""

    src: torch.Tensor  # ``[1, C]`` uint8, a view of the frame
    pages: torch.Tensor  # the local layer's ``[blocks, C]`` uint8 view
    block: int

    def write(self) -> None:
        self.pages[self.block : self.block + 1].copy_(self.src.to(self.pages.device))


def plan_states(
    part: dict[str, Any],
    layers: Sequence[tuple[StateLayoutId, torch.Tensor, int] | None],
    layer_offset: int = 0,
) -> list[StateCopy]:
    """The state copies of a payload (or part) whose layers are ``layers`` (per payload
    layer: ``(identity, local pages, local block)`` of a state layer, None for another);
    ``KVPayloadError`` when the payload lacks a state the local model keeps or its
    identity differs from the local one (the consumer then recomputes)."""
    blocks = part.get("layer_blocks")
    pages = blocks.get(STATE_PAGES) if isinstance(blocks, dict) else None
    wanted = [i for i, x in enumerate(layers) if x is not None]
    if not wanted:
        return []
    md = part.get("metadata") or {}
    declared = md.get(STATE_LAYOUTS)
    if not isinstance(pages, list) or len(pages) != len(layers) or not isinstance(declared, dict):
        raise KVPayloadError(
            "the payload carries no recurrent state (Mamba / GDN / short-conv layers), which "
            "this model keeps: producer and consumer must serve the same hybrid model"
        )
    out = []
    for i in wanted:
        ident, local, block = layers[i]  # type: ignore[misc]
        check_declared_state(declared, layer_offset + i, ident)
        src = pages[i]
        want = (1, ident.content_bytes)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != want or src.element_size() != 1:
            got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise KVPayloadError(f"layer {layer_offset + i}: state page {got}, expected {want}")
        if not 0 <= block < int(local.shape[0]):
            raise KVPayloadError(
                f"layer {layer_offset + i}: local state block {block} out of range"
            )
        out.append(StateCopy(src, local, block))
    return out


def _span(t: torch.Tensor, frame_address: int) -> Span:
    start = t.data_ptr() - frame_address
    return start, start + t.numel() * t.element_size()


class StatesPlan(BlocksPlan):
    """A paged-blocks plan plus the state pages of the same payload (or part)."""

    pages_only = False  # its state copies are tasks too

    def __init__(self, blocks: BlocksPlan, states: list[StateCopy]) -> None:
        super().__init__(blocks.tokens, blocks.copies, blocks.src_layout, blocks.dst_layout)
        self.states = states
        self.state_bytes = sum(c.src.numel() for c in states)

    def spans(self, frame_address: int | None) -> list[Span] | None:
        base = super().spans(frame_address)
        if base is None or frame_address is None:
            return None
        return merge_spans(base + [_span(c.src, frame_address) for c in self.states])

    def _tasks(self, frame_address: int | None) -> list[Any]:
        tasks = super()._tasks(frame_address)
        for c in self.states:
            host = c.src.device.type == "cpu" and addressable(c.pages) is not None
            if frame_address is None or not host:
                end = 0 if frame_address is None else _span(c.src, frame_address)[1]
                tasks.append((end, 0, 0, 0, None, c.write))
                continue
            nbytes = c.src.numel()
            dst = c.pages[c.block].data_ptr()
            view = memoryview((ctypes.c_char * nbytes).from_address(dst)).cast("B")
            end = _span(c.src, frame_address)[1]
            tasks.append((end, dst, c.src.data_ptr(), nbytes, view, None))
        tasks.sort(key=lambda t: t[0])
        return tasks
