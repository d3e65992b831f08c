"""A consumer's opened CUDA IPC handles: one per producer allocation and local device,
in use while a copy reads it, dropped once its producer is dead.

A handle is opened on the device the consumer copies into (its cache's device; the
calling thread's for a bare ``attach``), never on the producer's: CUDA maps the
allocation into that device's address space and enables peer access to the
producer's GPU itself (``cudaIpcMemLazyEnablePeerAccess``), so the consumer creates
no context on the producer's GPU and needs no index of it (two servers on disjoint
``CUDA_VISIBLE_DEVICES`` number their GPUs independently). Not run on a GPU in this
project's CI: ``tests/backends/cuda_ipc`` has the GPU tests (two GPUs for the disjoint
case).

A mapping keeps the producer's allocation alive: a producer that died (by the rules of
:mod:`vllm_omni_kv.backends.shm.liveness`) would hold its GPU memory until the
consumer exits, and a restarted one could run out. :meth:`IpcMappings.sweep` drops the
mappings of dead producers, except one whose copies may still run: a mapping counts
its users and remembers an event recorded after its last copy, and is dropped only
once no one uses it and that event has completed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_kv.backends.shm.liveness import HEARTBEAT_S
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.kvcache.device_order import DeviceEvent
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: opens a producer's handle on a local device: ``(device, share fields) -> uint8 view``
Opener = Callable[[torch.device, Sequence[Any]], torch.Tensor]
#: mapping key: (producer instance, IPC handle, offset in the allocation, local device)
Key = tuple[int, bytes, int, str]


def open_handle(device: torch.device, fields: Sequence[Any]) -> torch.Tensor:
    """A flat ``uint8`` tensor on local ``device`` over a producer's exported allocation
    (``fields``: ``UntypedStorage._share_cuda_()`` after its device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(index, *fields)
            view = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
            view.set_(storage, 0, (storage.nbytes(),), (1,))
    except RuntimeError as e:
        raise KVTransferError(
            f"opening the producer's CUDA IPC handle on cuda:{index} failed ({e}): the "
            "producer's GPU and this one need peer access (NVLink or PCIe P2P, same host); "
            "otherwise use the nixl or mooncake backend"
        ) from None
    return view


@dataclass
class Mapping:
    """One opened handle: the producer behind it, its view, and who uses it."""

    owner: int
    name: str  # the producer's heartbeat segment
    view: torch.Tensor
    pages: dict[Any, list[torch.Tensor]] = field(default_factory=dict)  # page views
    users: int = 0
    last_use: DeviceEvent | None = None  # recorded after the last copy out of it

    def idle(self) -> bool:
        return self.users == 0 and (self.last_use is None or self.last_use.query())


class IpcMappings:
    """The handles one consumer opened; ``alive(name, owner)`` tells a live producer."""

    def __init__(
        self,
        alive: Callable[[str, int], bool],
        opener: Opener = open_handle,
        sweep_every_s: float = HEARTBEAT_S,
    ) -> None:
        self.alive = alive
        self.opener = opener
        self.sweep_every_s = sweep_every_s
        self._maps: dict[Key, Mapping] = {}
        self._lock = threading.Lock()
        self._swept = 0.0

    def use(self, key: Key, owner: int, name: str, device: torch.device, fields: Any) -> Mapping:
        """The mapping of ``key`` (opened on ``device`` if new), in use until :meth:`done`."""
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                hit.users += 1
                return hit
        view = self.opener(device, fields)  # outside the lock: may take milliseconds
        with self._lock:
            hit = self._maps.setdefault(key, Mapping(owner, name, view))
            hit.users += 1
            return hit

    def done(self, mapping: Mapping, last_use: DeviceEvent | None) -> None:
        """A user is done; ``last_use``: an event after the copies it queued."""
        with self._lock:
            mapping.users -= 1
            if last_use is not None:
                mapping.last_use = last_use

    def sweep(self, force: bool = False) -> int:
        """Drop the idle mappings of dead producers (at most every ``sweep_every_s``
        unless ``force``); returns how many were dropped."""
        now = time.monotonic()
        if not force and now - self._swept < self.sweep_every_s:
            return 0
        self._swept = now
        with self._lock:
            owners = {(m.name, m.owner) for m in self._maps.values()}
        dead = {owner for name, owner in owners if not self.alive(name, owner)}
        return self.drop_owners(dead) if dead else 0

    def drop_owners(self, owners: set[int]) -> int:
        """Drop the idle mappings of ``owners`` (busy ones stay for a later sweep)."""
        with self._lock:
            gone = [k for k, m in self._maps.items() if m.owner in owners and m.idle()]
            for k in gone:
                del self._maps[k]
        if gone:
            logger.info("closed %d CUDA IPC mapping(s) of a producer that is gone", len(gone))
        return len(gone)

    def owners(self) -> set[int]:
        """The producers this consumer holds mappings of."""
        with self._lock:
            return {m.owner for m in self._maps.values()}

    def clear(self) -> None:
        """Drop every mapping (the consumer is closing; its copies have completed)."""
        with self._lock:
            self._maps.clear()
