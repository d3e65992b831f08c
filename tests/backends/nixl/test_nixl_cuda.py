"""NIXL with device memory (``VRAM``): pools on a CUDA device (``memory_pool_device: cuda``),
pulled whole, between every pair of pool kinds. ``make gpu-check`` runs these in its
``nixl_tests`` step, with ``tests/backends/test_conformance.py``'s ``register_cache`` test of
CUDA caches; without CUDA or NIXL they skip. Written on CPU: **not run on a GPU yet**."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.pool import ManagedBuffer

from ..conformance import nixl_config

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: (sender pool, receiver pool): VRAM <- VRAM, DRAM <- VRAM, VRAM <- DRAM
POOLS = [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]


def _pair(sender_pool: str, receiver_pool: str) -> tuple[Any, Any]:
    from vllm_omni_kv.backends.nixl.connector import NixlPullConnector

    sender = NixlPullConnector(nixl_config("sender", pool_mib=32, memory_pool_device=sender_pool))
    try:
        receiver = NixlPullConnector(
            nixl_config("receiver", pool_mib=32, memory_pool_device=receiver_pool)
        )
    except BaseException:
        sender.close()
        raise
    return sender, receiver


def _data(device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (1024, 1024), generator=g, dtype=torch.int32).to(
        device
    )


@pytest.mark.parametrize(("sender_pool", "receiver_pool"), POOLS)
def test_a_tensor_moves_exactly_between_pools(sender_pool: str, receiver_pool: str) -> None:
    """4 MiB put from the sender's pool arrive bit for bit in the receiver's, on its
    pool's device; both pools are empty afterwards."""
    sender, receiver = _pair(sender_pool, receiver_pool)
    try:
        t = _data(sender_pool, seed=1)
        ok, _size, meta = sender.put("0", "1", "t", t)
        assert ok
        got = receiver.get("0", "1", "t", meta)
        assert got is not None
        buf = got[0]
        assert isinstance(buf, ManagedBuffer)
        with buf:
            out = buf.to_tensor()
            assert out.device.type == torch.device(receiver_pool).type
            assert torch.equal(out.cpu(), t.cpu())
        assert receiver.pool.allocator.used == 0
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize(("sender_pool", "receiver_pool"), POOLS)
def test_an_object_frame_moves_with_its_digests_checked(
    sender_pool: str, receiver_pool: str
) -> None:
    """A dict (a frame: packed on the sender's pool device, with chunk digests) comes back
    equal, its digests verified on the receiver's side."""
    sender, receiver = _pair(sender_pool, receiver_pool)
    try:
        t = _data(sender_pool, seed=2)
        ok, _size, meta = sender.put("0", "1", "o", {"k": t, "name": "r"})
        assert ok
        got = receiver.get("0", "1", "o", meta)
        assert got is not None
        obj = got[0]
        assert obj["name"] == "r" and torch.equal(obj["k"].cpu(), t.cpu())
    finally:
        receiver.close()
        sender.close()


def test_a_device_pool_is_registered_as_vram() -> None:
    """The engine registers a CUDA pool as ``VRAM`` of its device, a host pool as ``DRAM``."""
    sender, receiver = _pair("cuda", "cpu")
    try:
        assert sender.pool.tensor.device.type == "cuda"
        assert sender._nixl is not None and receiver._nixl is not None
        assert (sender._nixl.mem_type, receiver._nixl.mem_type) == ("VRAM", "DRAM")
    finally:
        receiver.close()
        sender.close()
