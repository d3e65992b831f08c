"""``KVCacheTransferData``: one request's KV blocks, packed for transfer.

The wire format is the frame of :mod:`vllm_omni_kv.wire.codec`; the
object it carries is :meth:`KVCacheTransferData.to_dict`, i.e.
``{"request_id", "layer_blocks", "block_ids", "metadata"}`` where
``layer_blocks`` maps names (``"key_cache"``, ``"value_cache"``) to per-layer
lists of ``[seq_len, num_heads, head_dim]`` tensors (``None`` for a layer that
is not transferred).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire import codec


@dataclass
class KVCacheTransferData:
    """Container for KV cache transfer data."""

    request_id: str
    layer_blocks: dict[str, Any]
    block_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Convert to dictionary for serialization (tensors are not copied)."""
        return {
            "request_id": self.request_id,
            "layer_blocks": self.layer_blocks,
            "block_ids": list(self.block_ids),
            "metadata": self.metadata,
        }

    def frame(self, chunk_bytes: int | None = None) -> codec.Frame:
        """The laid-out frame; ``frame().pack_into(buf)`` writes it with one copy.

        ``chunk_bytes``: bytes per digested chunk (e.g. one paged block), default 256 KiB.
        """
        return codec.encode(self.to_dict(), chunk_bytes)

    def packed_size(self) -> int:
        return self.frame().nbytes

    def to_bytes(self) -> bytearray:
        """Pack into a new bytes-like buffer (one copy of the tensor bytes)."""
        return self.frame().to_bytearray()

    def to_device_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Pack into one ``uint8`` tensor on ``device`` (default: the tensors' device)."""
        return self.frame().to_device_tensor(device)

    #: GPU-named alias kept for callers of the original API.
    to_gpu_tensor = to_device_tensor

    @staticmethod
    def from_bytes(raw: bytes | bytearray | memoryview, verify: bool = True) -> dict[str, Any]:
        """Reconstruct the dict from packed bytes; tensors are zero-copy views of ``raw``."""
        return _check_kv_dict(codec.decode(raw, verify=verify))

    @staticmethod
    def from_bytes_device(tensor: torch.Tensor, verify: bool = True) -> dict[str, Any]:
        """Reconstruct from a packed ``uint8`` tensor; tensors are views on its device."""
        return _check_kv_dict(codec.decode_tensor(tensor, verify=verify))

    #: GPU-named alias kept for callers of the original API.
    from_bytes_gpu = from_bytes_device

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCacheTransferData:
        d = _check_kv_dict(d)
        return cls(d["request_id"], d["layer_blocks"], list(d["block_ids"]), d["metadata"])


def _check_kv_dict(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise KVPayloadError(f"KV payload must decode to a dict, got {type(obj).__name__}")
    missing = {"request_id", "layer_blocks", "block_ids", "metadata"} - set(obj)
    if missing:
        raise KVPayloadError(f"KV payload lacks field(s) {sorted(missing)}")
    if not isinstance(obj["request_id"], str):
        raise KVPayloadError("KV payload request_id must be a string")
    if not isinstance(obj["layer_blocks"], dict):
        raise KVPayloadError("KV payload layer_blocks must be a mapping")
    if not isinstance(obj["block_ids"], list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in obj["block_ids"]
    ):
        raise KVPayloadError("KV payload block_ids must be a list of ints")
    for name, layers in obj["layer_blocks"].items():
        items = layers if isinstance(layers, list) else [layers]
        for i, t in enumerate(items):
            if t is not None and not isinstance(t, torch.Tensor):
                raise KVPayloadError(
                    f"KV payload layer_blocks[{name!r}][{i}] must be a tensor or None, "
                    f"got {type(t).__name__}"
                )
    if obj["metadata"] is None:
        obj["metadata"] = {}
    if not isinstance(obj["metadata"], dict):
        raise KVPayloadError("KV payload metadata must be a mapping")
    return obj
