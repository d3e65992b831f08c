"""A received pool buffer's tensor view (:meth:`~vllm_omni_kv.backends.pool.ManagedBuffer.to_tensor`):
its dtype and shape come from the sender, so only a dtype this build knows and a shape of
non-negative integers that fits in the buffer make a view; anything else is a
``KVPayloadError``, and no shape makes the receiver allocate (an empty buffer described as
a huge tensor, say)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_omni_kv.backends.pool import MemoryPool
from vllm_omni_kv.backends.pull.staging import sized
from vllm_omni_kv.errors import KVPayloadError


@pytest.fixture(scope="module")
def pool() -> MemoryPool:
    return MemoryPool(1 << 20, "cpu")


def _received(pool: MemoryPool, data: bytes, dtype: Any, shape: Any) -> Any:
    buf = sized(pool.alloc(max(len(data), 1)), len(data))
    if data:
        buf.tensor[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buf.dtype_name, buf.shape = dtype, shape
    return buf


def test_the_dtype_and_shape_a_sender_put_make_the_view(pool: MemoryPool) -> None:
    t = torch.arange(12, dtype=torch.int32).view(3, 4)
    with _received(pool, t.numpy().tobytes(), "int32", [3, 4]) as buf:
        assert torch.equal(buf.to_tensor(), t)
    with _received(pool, b"", "float32", [0, 7]) as buf:
        assert buf.to_tensor().shape == (0, 7)


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (["int32"], [4]),
        ("no-such-dtype", [4]),
        ("int32", [-1]),
        ("int32", [2.0]),
        ("int32", "16"),
        ("int32", [1 << 20, 1 << 20]),
        ("int32", [5]),
        ("int32", [1] * 65),
        ("int32", [True]),
    ],
    ids=[
        "dtype list",
        "unknown dtype",
        "negative",
        "float dim",
        "str shape",
        "huge",
        "too big",
        "65 dims",
        "bool dim",
    ],  # fmt: skip
)
def test_a_dtype_or_shape_that_is_not_the_buffers_is_a_payload_error(
    pool: MemoryPool, dtype: Any, shape: Any
) -> None:
    with _received(pool, bytes(16), dtype, shape) as buf, pytest.raises(KVPayloadError):
        buf.to_tensor()


def test_an_empty_buffer_described_as_a_huge_tensor_allocates_nothing(pool: MemoryPool) -> None:
    with _received(pool, b"", "float32", [1 << 16, 1 << 16]) as buf, pytest.raises(KVPayloadError):
        buf.to_tensor()
