"""Normalise a layer's paged KV cache, whatever the attention backend's layout.

Every layout maps to ``(key_blocks, value_blocks)`` views of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` that share storage with the
cache, so writing into them injects.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.cache_layout import (
    KVLayoutId,
    block_kv,
    check_view,
    infer_identity,
    token_views,
)
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: Layout names understood by :func:`normalize_layer_kv` / :func:`detect_kv_layout`.
KV_LAYOUTS: tuple[str, ...] = ("flash", "flashinfer", "cpu", "tuple")


def _warn_invalid(req_id: str, layer_idx: int, why: str) -> None:
    logger.warning("Invalid KV cache for request %r layer %d: %s", req_id, layer_idx, why)


def detect_kv_layout(layer_kv: Any) -> str:
    """Return the layout name of a layer KV cache (one of :data:`KV_LAYOUTS`).

    A 5-D tensor with both dim 0 and dim 1 equal to 2 is reported as
    ``"flash"``.  Raises KVPayloadError when no layout matches.
    """
    if isinstance(layer_kv, tuple | list):
        if len(layer_kv) == 2 and all(isinstance(t, torch.Tensor) for t in layer_kv):
            return "tuple"
        raise KVPayloadError("a KV tuple must hold exactly two tensors (key, value)")
    if not isinstance(layer_kv, torch.Tensor):
        raise KVPayloadError(f"KV cache must be a tensor or a tuple, got {type(layer_kv).__name__}")
    if layer_kv.dim() == 5:
        if layer_kv.shape[0] == 2:
            return "flash"
        if layer_kv.shape[1] == 2:
            return "flashinfer"
        raise KVPayloadError(f"5-D KV cache {tuple(layer_kv.shape)} has no K/V dim of size 2")
    if layer_kv.dim() == 4:
        return "cpu"
    raise KVPayloadError(f"unsupported {layer_kv.dim()}-D KV cache {tuple(layer_kv.shape)}")


def _split(layer_kv: Any, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "tuple":
        key, value = layer_kv
        if key.dim() != 4 or key.shape != value.shape:
            raise KVPayloadError(
                f"tuple K/V must both be [nb, bs, h, d], got {tuple(key.shape)} / {tuple(value.shape)}"
            )
        if key.dtype != value.dtype or key.device != value.device:
            raise KVPayloadError("tuple K/V differ in dtype or device")
        return key, value
    if layout == "flash":
        if layer_kv.dim() != 5 or layer_kv.shape[0] != 2:
            raise KVPayloadError(
                f"flash layout needs [2, nb, bs, h, d], got {tuple(layer_kv.shape)}"
            )
        return layer_kv[0], layer_kv[1]
    if layout == "flashinfer":
        if layer_kv.dim() != 5 or layer_kv.shape[1] != 2:
            raise KVPayloadError(
                f"flashinfer layout needs [nb, 2, bs, h, d], got {tuple(layer_kv.shape)}"
            )
        return layer_kv[:, 0], layer_kv[:, 1]
    # cpu: [nb, h, bs, 2*d], vLLM's CPU packing (K transposed, then V, per block and head;
    # see cache_layout.token_views)
    if layer_kv.dim() != 4 or layer_kv.shape[3] % 2 != 0:
        raise KVPayloadError(f"cpu layout needs [nb, h, bs, 2*d], got {tuple(layer_kv.shape)}")
    try:
        key, value = token_views(layer_kv, infer_identity(layer_kv, packing="kt_v"))
    except ConfigError as exc:
        raise KVPayloadError(f"cpu-layout KV cache cannot be viewed per block/head: {exc}") from exc
    assert value is not None
    return key, value


def _identity_views(
    layer_kv: Any, ident: KVLayoutId, req_id: str, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not isinstance(layer_kv, torch.Tensor):
        _warn_invalid(req_id, layer_idx, f"layout {ident.layout} needs vLLM's 4-D view")
        return None
    try:
        check_view(layer_kv, ident)
    except ConfigError as exc:
        _warn_invalid(req_id, layer_idx, str(exc))
        return None
    kv = block_kv(layer_kv, ident)
    if kv is None:
        why = {
            "latent": "an MLA latent cache has no separate K and V",
            "packed": "packed cache cells have no separate K and V",
        }.get(
            ident.packing,
            "kernel blocks split a head-major block, so a block's tokens are not one view",
        )
        _warn_invalid(req_id, layer_idx, f"{ident.describe()}: {why}")
    return kv


def normalize_layer_kv(
    layer_kv: LayerKV,
    *,
    req_id: str = "",
    layer_idx: int = -1,
    layout: str | KVLayoutId | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Normalize one layer KV cache to a ``(key_blocks, value_blocks)`` tuple.

    Both are views ``[num_blocks, block_size, num_kv_heads, head_dim]`` sharing
    storage with the cache, so writing into them injects.  ``layout`` is the
    cache's :class:`~vllm_omni_kv.kvcache.cache_layout.KVLayoutId` (vLLM 0.32's 4-D
    views: what the connector passes), or one of these names:

    * ``"flash"`` (FlashAttention): ``[2, nb, bs, h, d]``, K/V at dim 0.
    * ``"flashinfer"``: ``[nb, 2, bs, h, d]``, K/V at dim 1.
    * ``"tuple"``: ``(key, value)``, each ``[nb, bs, h, d]``, returned as-is.
    * ``"cpu"`` (vLLM CPU backend): ``[nb, h, bs, 2*d]`` whose memory per
      (block, head) is K transposed (``[d, bs]``) followed by V (``[bs, d]``).
      A 4-D tensor without a ``layout`` is read this way (vLLM's CPU backend); pass
      the identity for vLLM's GPU views.

    A 5-D tensor with dim 0 and dim 1 both 2 is ambiguous and read as
    ``"flash"`` unless ``layout`` says otherwise.  Invalid input logs a
    warning (naming ``req_id``/``layer_idx``) and returns None; an unknown
    ``layout`` name raises ConfigError.
    """
    if isinstance(layout, KVLayoutId):
        return _identity_views(layer_kv, layout, req_id, layer_idx)
    if layout is not None and layout not in KV_LAYOUTS:
        raise ConfigError(f"layout must be a KVLayoutId or one of {KV_LAYOUTS}, got {layout!r}")
    try:
        if layout is None:
            layout = detect_kv_layout(layer_kv)
        elif layout == "tuple":
            if detect_kv_layout(layer_kv) != "tuple":
                raise KVPayloadError("layout 'tuple' needs a (key, value) tuple")
        elif not isinstance(layer_kv, torch.Tensor):
            raise KVPayloadError(f"layout {layout!r} needs a single tensor")
        return _split(layer_kv, layout)
    except KVPayloadError as exc:
        _warn_invalid(req_id, layer_idx, str(exc))
        return None
