"""TP/CFG-aware KV receive across ``torch.distributed`` ranks.

Path selection (world = tp_size * cfg_size, rank = cfg_rank * tp_size + tp_rank):

* world size 1, or ``torch.distributed`` not initialised: direct receive;
* TP active, CFG size 1: every rank receives its own shard independently;
* TP active, CFG size > 1: the CFG-rank-0 member of each TP rank receives, then
  broadcasts to the peers sharing its TP rank;
* TP inactive: rank 0 receives, then broadcasts to the whole world.

Broadcasts carry the packed frame (no pickle): a length, then the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.kv_utils import get_tp_world_size
from vllm_omni_kv.kvcache.token_major import to_device
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec


class Receiver(Protocol):
    """What the distributed receive needs of ``OmniKVTransferManager``."""

    def receive_multi_kv_cache(
        self, req: Any, cfg_kv_collect_func: Callable | None, target_device: torch.device | None
    ) -> bool: ...

    def receive_primary_and_companions(
        self, req: Any, func: Callable | None, target_device: torch.device | None
    ) -> tuple[bool, dict[str, Any]]: ...

    def apply_kv_cache_to_request(self, req: Any, data: dict[str, Any]) -> None: ...


logger = init_logger(__name__)

_GROUP_CACHE: dict[tuple[int, int], Any] = {}


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _groups_by_tp_rank(tp_size: int, world: int) -> Any:
    """Per TP rank, the group of ranks sharing it (created collectively, cached)."""
    key = (tp_size, world)
    if key not in _GROUP_CACHE:
        groups = []
        for tp_rank in range(tp_size):
            ranks = list(range(tp_rank, world, tp_size))
            groups.append(torch.distributed.new_group(ranks=ranks))
        _GROUP_CACHE[key] = groups
    return _GROUP_CACHE[key]


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """Broadcast a frame-encodable object from global rank ``src`` (no pickle)."""
    dist = torch.distributed
    rank = dist.get_rank()
    if rank == src:
        payload = torch.frombuffer(codec.encode(obj).to_bytearray(), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return obj if rank == src else codec.decode(payload.numpy())


def receive_multi_distributed(
    manager: Receiver,
    req: Any,
    func: Callable | None,
    target_device: torch.device | None,
    *,
    tp_size: int | None = None,
) -> bool:
    """See the module docstring; returns whether the primary KV arrived on this rank."""
    if not _dist_ready() or torch.distributed.get_world_size() == 1:
        return manager.receive_multi_kv_cache(req, func, target_device)
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = int(tp_size) if tp_size is not None else get_tp_world_size()
    if tp < 1 or world % tp:
        raise ConfigError(f"world size {world} is not a multiple of the TP size {tp}")
    cfg_size = world // tp
    if tp > 1 and cfg_size == 1:
        return manager.receive_multi_kv_cache(req, func, target_device)
    if tp > 1:
        tp_rank = rank % tp
        group = _groups_by_tp_rank(tp, world)[tp_rank]
        src = tp_rank  # cfg rank 0 of this TP rank
    else:
        group, src = None, 0
    result: dict[str, Any] = {"ok": False}
    if rank == src:
        ok, extras = manager.receive_primary_and_companions(req, func, None)
        result = {"ok": ok}
        if ok:
            result["data"] = _primary_payload(req)
            result["extras"] = extras
    result = broadcast_object(result, src=src, group=group)
    if not result.get("ok"):
        return False
    if rank != src:
        manager.apply_kv_cache_to_request(req, result["data"])
    _finish(manager, req, result, target_device)
    return True


def _primary_payload(req: Any) -> dict[str, Any]:
    pkv = req.past_key_values
    return {
        "request_id": pkv.request_id,
        "layer_blocks": {"key_cache": pkv.key_cache, "value_cache": pkv.value_cache},
        "block_ids": pkv.block_ids,
        "metadata": getattr(req, "kv_metadata", {}),
    }


def _finish(
    manager: Receiver,
    req: Any,
    result: dict[str, Any],
    target_device: torch.device | None,
) -> None:
    if target_device is not None:
        manager.apply_kv_cache_to_request(req, to_device(_primary_payload(req), target_device))
    extras = result.get("extras") or {}
    if extras:
        target = getattr(req, "sampling_params", None) or req
        for k, v in extras.items():
            setattr(target, k, v)
