"""Placing a put's data in the sender's registered pool (the only copy on the sender).

A frame put into a device pool is packed on the device straight into the pool block
(its bytes queued on the putting thread's stream, each byte copied once); the block is exposed
(``put`` returns its address) only once an event recorded after that copy completed,
so a consumer never pulls a block whose bytes are still queued.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import numpy as np
import torch

from vllm_omni_kv.backends.pool import ManagedBuffer, MemoryPool
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.kvcache.device_order import settle, streams_of
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.payload import KVCacheTransferData


def stage_in_pool(
    pool: MemoryPool, data: Any, *, checksum: bool = True
) -> tuple[ManagedBuffer, int, bool, str | None, list[int] | None]:
    """Place ``data`` in ``pool``: ``(buffer, size, fast, dtype, shape)``.

    A buffer of ``pool`` is used as is (zero copy), a tensor or bytes are copied
    once (``fast``: a raw buffer), any other object is packed as a frame straight
    into the pool (with chunk digests unless ``checksum`` is False).
    """
    # copied by the CPU: not for a device pool (nor for a host pool given stream
    # operations, which is how tests check the order of the device path)
    host = pool.device.type == "cpu" and streams_of(pool.tensor.device) is None
    if isinstance(data, ManagedBuffer):
        if pool.owns(data):
            if data.released:
                raise KVTransferError("cannot put a ManagedBuffer that was already released")
            return data, data.size, True, None, None  # zero copy: we now own it
        data = data.tensor
    if isinstance(data, torch.Tensor):
        return _stage_tensor(pool, data, host)
    if isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data).cast("B")
        buf = pool.alloc(max(mv.nbytes, 1))
        if mv.nbytes and host:
            buf.tensor.numpy()[: mv.nbytes] = np.frombuffer(mv, dtype=np.uint8)
        elif mv.nbytes:
            with warnings.catch_warnings():  # read-only sources are fine to copy from
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(mv, dtype=torch.uint8)
            buf.tensor[: mv.nbytes].copy_(src)
            _settle(pool)
        return sized(buf, mv.nbytes), mv.nbytes, True, None, None
    if isinstance(data, KVCacheTransferData):
        frame = data.frame()
    elif isinstance(data, codec.Frame):
        frame = data
    else:
        frame = codec.encode(data)
    buf = pool.alloc(frame.nbytes)
    try:
        if host:
            size = frame.pack_into(buf.tensor.numpy(), checksum=checksum)
        else:
            # packed straight into the block: the data is copied once
            size = frame.to_device_tensor(out=buf.tensor, on_device=True).numel()
            _settle(pool)
    except BaseException:
        buf.release()
        raise
    return sized(buf, size), size, False, None, None


def _stage_tensor(
    pool: MemoryPool, data: torch.Tensor, host: bool
) -> tuple[ManagedBuffer, int, bool, str | None, list[int] | None]:
    name = codec.DTYPE_NAMES.get(data.dtype)
    if name is None:
        raise KVTransferError(f"tensor dtype {data.dtype} is not supported")
    n = data.numel() * data.element_size()
    buf = pool.alloc(max(n, 1))
    try:
        if n and host and data.device.type == "cpu" and data.is_contiguous():
            # one plain memcpy: torch's copy_ goes through its intra-op thread pool,
            # which costs milliseconds per call on a busy host
            ctypes.memmove(buf.address, data.data_ptr(), n)
        elif n:
            buf.tensor[:n].view(data.dtype).view(data.shape).copy_(data)
            _settle(pool)
    except BaseException:
        buf.release()
        raise
    return sized(buf, n), n, True, name, list(data.shape)


def _settle(pool: MemoryPool) -> None:
    """Return once the copies queued into ``pool`` (a device pool) have run: the block is
    exposed only when it holds its bytes (a no-op for a host pool)."""
    device = pool.tensor.device
    streams = streams_of(device)
    if streams is not None:
        settle(streams, device)


def sized(buf: ManagedBuffer, size: int) -> ManagedBuffer:
    """Report the payload size (not the aligned block size) on a pool buffer."""
    buf.size = size
    return buf
