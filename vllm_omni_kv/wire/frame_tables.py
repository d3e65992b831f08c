"""Validation of a frame header's tensor and blob tables and chunk size (layout: :mod:`.codec`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError

MAX_NDIM = 8
#: largest tensor dimension a frame may declare (a zero-size tensor's other dims included)
MAX_DIM = 1 << 48
#: largest product of a tensor's dimensions (zeros counted as 1) times its item size: a
#: zero-size tensor's shape must still be one torch can allocate (its strides fit)
MAX_EXTENT = 1 << 48


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_tensor_table(
    table: Any, data_len: int, dtypes: dict[str, torch.dtype]
) -> list[tuple[torch.dtype, list[int], int, int]]:
    if not isinstance(table, list):
        raise KVPayloadError("frame tensor table must be a list")
    out = []
    for i, entry in enumerate(table):
        if not (isinstance(entry, list) and len(entry) == 4):
            raise KVPayloadError(f"tensor #{i}: descriptor must be [dtype, shape, offset, nbytes]")
        name, shape, off, nbytes = entry
        dtype = dtypes.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise KVPayloadError(f"tensor #{i}: unsupported dtype {name!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)
        ):
            raise KVPayloadError(f"tensor #{i}: bad shape {shape!r}")
        if not (_is_int(off) and _is_int(nbytes)) or off < 0 or nbytes < 0:
            raise KVPayloadError(f"tensor #{i}: bad offset/nbytes {off!r}/{nbytes!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        extent = math.prod(max(d, 1) for d in shape) * itemsize
        if extent > MAX_EXTENT:
            raise KVPayloadError(
                f"tensor #{i}: shape {shape} spans {extent} bytes (empty dimensions counted "
                f"as 1), over the {MAX_EXTENT}-byte limit: not a vllm-omni-kv payload"
            )
        if math.prod(shape) * itemsize != nbytes:
            raise KVPayloadError(
                f"tensor #{i}: shape {shape} of {name} needs {math.prod(shape) * itemsize} "
                f"bytes, descriptor says {nbytes}"
            )
        if off % itemsize:
            raise KVPayloadError(f"tensor #{i}: offset {off} is not aligned to {itemsize} bytes")
        if off + nbytes > data_len:
            raise KVPayloadError(
                f"tensor #{i}: span [{off}, {off + nbytes}) is out of the {data_len}-byte data region"
            )
        out.append((dtype, shape, off, nbytes))
    return out


def check_blob_table(table: Any, data_len: int) -> list[tuple[int, int]]:
    if not isinstance(table, list):
        raise KVPayloadError("frame blob table must be a list")
    out = []
    for i, entry in enumerate(table):
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and all(_is_int(x) and x >= 0 for x in entry)
        ):
            raise KVPayloadError(f"blob #{i}: descriptor must be [offset, nbytes]")
        off, nbytes = entry
        if off + nbytes > data_len:
            raise KVPayloadError(f"blob #{i}: span out of the {data_len}-byte data region")
        out.append((off, nbytes))
    return out


def check_chunk_bytes(value: Any, lo: int, hi: int) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        raise KVPayloadError(f"frame chunk size {value!r} is not an integer in [{lo}, {hi}]")
    return int(value)
