"""The one metadata schema of a KV payload, whichever format it travels in.

A payload is ``{"request_id", "layer_blocks", "block_ids", "metadata"}``
(:class:`~vllm_omni_kv.wire.payload.KVCacheTransferData`); ``metadata`` is a flat
mapping whose known keys :class:`PayloadMeta` reads and checks. Other keys (the
producer's engine id and TP rank, a prompt digest, stage names...) ride along
untouched; layer-wise parts add theirs (:mod:`vllm_omni_kv.transfer.parts`).

Formats:

* ``paged_blocks``: each layer's pages as the cache holds them
  (``layer_blocks["kv_blocks"]``); ``kv_layout`` is the producer's layout identity
  (:class:`~vllm_omni_kv.kvcache.cache_layout.KVLayoutId` as a mapping).
* ``token_major``: ``[rows, heads, head_dim]`` K and V per layer
  (``layer_blocks["key_cache"]`` / ``["value_cache"]``).
* ``shared_pages``: no KV bytes; block ids in a cache the consumer maps
  (:mod:`vllm_omni_kv.kvcache.shared_pages`), with ``kv_layout`` as for paged blocks.

Both carry ``num_tokens`` (tokens of KV described), ``block_size``, ``rows``
(token slots each layer's tensors hold: whole blocks for ``paged_blocks``, at
least ``num_tokens`` for ``token_major``) and ``num_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import KVLayoutId

PAGED_BLOCKS = "paged_blocks"
TOKEN_MAJOR = "token_major"
SHARED_PAGES = "shared_pages"
FORMATS = (PAGED_BLOCKS, TOKEN_MAJOR, SHARED_PAGES)

_INTS = ("num_tokens", "block_size", "rows", "num_layers")


def _int_field(md: dict[str, Any], name: str) -> int:
    v = md.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise KVPayloadError(f"KV payload metadata field {name!r} must be an int >= 0, got {v!r}")
    return v


@dataclass(frozen=True)
class PayloadMeta:
    """The checked, format-level fields of a payload's metadata."""

    format: str
    num_tokens: int
    block_size: int
    rows: int
    num_layers: int
    kv_layout: KVLayoutId | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise KVPayloadError(
                f"unknown KV payload format {self.format!r} (this build reads {', '.join(FORMATS)})"
            )
        if self.block_size < 1:
            raise KVPayloadError("KV payload block_size must be >= 1")
        if self.rows < self.num_tokens:
            raise KVPayloadError(
                f"KV payload holds {self.rows} token rows for {self.num_tokens} tokens"
            )
        if self.format in (PAGED_BLOCKS, SHARED_PAGES):
            if self.rows % self.block_size:
                raise KVPayloadError("a paged-blocks payload holds whole blocks")
            if self.kv_layout is None:
                raise KVPayloadError("a paged-blocks payload must carry its layout identity")
            if self.kv_layout.block_size != self.block_size:
                raise KVPayloadError(
                    "a paged-blocks payload's block size differs from its layout's"
                )

    @property
    def num_blocks(self) -> int:
        """Blocks of ``block_size`` the payload's rows span."""
        return -(-self.rows // self.block_size)

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """The metadata mapping: these fields plus ``extra``."""
        md: dict[str, Any] = {
            **extra,
            "format": self.format,
            "num_tokens": self.num_tokens,
            "block_size": self.block_size,
            "rows": self.rows,
            "num_layers": self.num_layers,
        }
        if self.kv_layout is not None:
            md["kv_layout"] = self.kv_layout.to_dict()
        return md

    @classmethod
    def of(cls, payload: Any) -> PayloadMeta:
        """Read and check the metadata of a received payload mapping."""
        md = payload.get("metadata") if isinstance(payload, dict) else None
        if not isinstance(md, dict):
            raise KVPayloadError("KV payload has no metadata mapping")
        fmt = md.get("format")
        raw = md.get("kv_layout")
        layout = None if raw is None else KVLayoutId.from_dict(raw)
        num_tokens, block_size, rows, num_layers = (_int_field(md, n) for n in _INTS)
        return cls(str(fmt), num_tokens, block_size, rows, num_layers, layout)
