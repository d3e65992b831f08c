"""The packed frame: how every object crosses a process boundary (no pickle).

Layout (little endian)::

    offset 0   prelude, 32 bytes
               magic b"OMKV" | u16 version | u8 checksum_alg | u8 flags
               | u32 header_len | u64 data_len | u64 checksum
    offset 32  header: msgpack map {"t": tensors, "b": blobs, "v": tree}
               tensors: [[dtype, shape, offset, nbytes], ...]
               blobs:   [[offset, nbytes], ...]
               tree:    the object itself; tensors and large byte strings are
                        msgpack ext refs (code 1 / 2, u32 index) into the tables
    data_start = align_up(32 + header_len, 64)
               raw tensor / blob bytes, each span 64-byte aligned (offsets are
               relative to data_start)
    total      = data_start + data_len

The checksum (xxh3-64, ``checksum_alg == 1``) covers bytes ``[32, total)``.
Frames packed on an accelerator carry ``checksum_alg == 0`` (none): their
transports (RDMA, NVLink) have their own integrity checks.
"""

from __future__ import annotations

import ctypes
import math
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.transfer.frame_tables import check_blob_table, check_tensor_table

MAGIC = b"OMKV"
VERSION = 1
PRELUDE = struct.Struct("<4sHBBIQQ")
PRELUDE_SIZE = 32
CHECKSUM_OFFSET = 20  # the prelude's checksum field
ALIGN = 64
CHECKSUM_NONE = 0
CHECKSUM_XXH3 = 1
EXT_TENSOR = 1
EXT_BLOB = 2
#: byte strings at least this long travel as raw blobs instead of inside the header
BLOB_MIN = 1024
MAX_HEADER = 64 << 20
#: packing copies and checksums this many bytes at a time, so each step is hashed while in cache
PACK_STEP = 256 << 10

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class LazyTensor:
    """A tensor whose bytes are produced straight into the frame by ``fill(dst)``.

    Used to gather KV blocks from a paged cache directly into a transport
    buffer, with no intermediate copy. ``fill`` may return an iterator of
    "bytes of ``dst`` written so far": the packer then checksums each step
    while it is still in cache instead of re-reading the whole span.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], Iterator[int] | None]
    device: torch.device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


TensorLike = torch.Tensor | LazyTensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Ref:
    __slots__ = ("code", "index")

    def __init__(self, code: int, index: int) -> None:
        self.code = code
        self.index = index


class Frame:
    """An object laid out for packing; ``nbytes`` is known before any copy."""

    def __init__(self, obj: Any) -> None:
        self.tensors: list[TensorLike] = []
        self.blobs: list[memoryview] = []
        tree = self._prepare(obj)
        tensor_table: list[list[Any]] = []
        blob_table: list[list[int]] = []
        off = 0
        for t in self.tensors:
            name = DTYPE_NAMES.get(t.dtype)
            if name is None:
                raise KVPayloadError(
                    f"tensor dtype {t.dtype} is not supported by the frame format; "
                    f"supported: {', '.join(sorted(DTYPES))}"
                )
            nbytes = t.nbytes if isinstance(t, LazyTensor) else t.numel() * t.element_size()
            tensor_table.append([name, list(t.shape), off, nbytes])
            off = align_up(off + nbytes)
        for b in self.blobs:
            blob_table.append([off, b.nbytes])
            off = align_up(off + b.nbytes)
        self.header: bytes = msgpack.packb(
            {"t": tensor_table, "b": blob_table, "v": tree}, use_bin_type=True
        )
        self.tensor_table = tensor_table
        self.blob_table = blob_table
        self.data_start = align_up(PRELUDE_SIZE + len(self.header))
        self.data_len = off
        self.nbytes = self.data_start + self.data_len

    def _prepare(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, LazyTensor)):
            self.tensors.append(obj)
            return msgpack.ExtType(EXT_TENSOR, struct.pack("<I", len(self.tensors) - 1))
        if isinstance(obj, (bytes, bytearray, memoryview)):
            mv = memoryview(obj).cast("B")
            if mv.nbytes < BLOB_MIN:
                return bytes(mv)
            self.blobs.append(mv)
            return msgpack.ExtType(EXT_BLOB, struct.pack("<I", len(self.blobs) - 1))
        if isinstance(obj, dict):
            return {k: self._prepare(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self._prepare(v) for v in obj]
        if obj is None or isinstance(obj, (str, int, float, bool)):
            return obj
        raise KVPayloadError(
            f"cannot serialize an object of type {type(obj).__name__}: frames carry "
            "tensors, bytes, str/int/float/bool/None and lists/dicts of them"
        )

    # -- packing -----------------------------------------------------------------
    def _write_prelude(self, mv: memoryview, alg: int, checksum: int) -> None:
        PRELUDE.pack_into(mv, 0, MAGIC, VERSION, alg, 0, len(self.header), self.data_len, checksum)
        mv[PRELUDE.size : PRELUDE_SIZE] = bytes(PRELUDE_SIZE - PRELUDE.size)

    def pack_into(self, buf: Any, *, checksum: bool = True) -> int:
        """Write the frame into a writable host buffer (bytearray, mmap, ...); return its size."""
        for _ in self.iter_pack(buf, checksum=checksum):
            pass
        return self.nbytes

    def iter_pack(self, buf: Any, *, checksum: bool = True) -> Iterator[int]:
        """Write the frame step by step, yielding how many leading bytes are final.

        The first value is ``data_start`` (prelude and header written, the prelude's
        checksum still 0); then one value per copied step of at most ``PACK_STEP``
        bytes; the last is ``nbytes``, yielded after the checksum is in place. A
        reader that follows these values may use each step as soon as it is yielded.
        """
        mv = memoryview(buf).cast("B")
        if mv.readonly:
            raise KVPayloadError("pack_into needs a writable buffer")
        if mv.nbytes < self.nbytes:
            raise KVPayloadError(
                f"buffer of {mv.nbytes} bytes cannot hold a {self.nbytes}-byte frame"
            )
        alg = CHECKSUM_XXH3 if checksum else CHECKSUM_NONE
        self._write_prelude(mv, alg, 0)
        h_end = PRELUDE_SIZE + len(self.header)
        mv[PRELUDE_SIZE:h_end] = self.header
        mv[h_end : self.data_start] = bytes(self.data_start - h_end)
        # Hash each step right after writing it, while it is still in cache.
        hasher = xxhash.xxh3_64() if checksum else None
        hashed = PRELUDE_SIZE
        yield self.data_start
        base = self.data_start
        spans: list[tuple[int, int, Any]] = [
            (off, nbytes, t) for t, (_d, _s, off, nbytes) in zip(self.tensors, self.tensor_table)
        ]
        spans += [(off, nbytes, b) for b, (off, nbytes) in zip(self.blobs, self.blob_table)]
        for i, (off, nbytes, src) in enumerate(spans):
            end = base + (spans[i + 1][0] if i + 1 < len(spans) else self.data_len)
            if nbytes:
                for done in _write_span(mv, base + off, nbytes, src):
                    if hasher is not None:
                        hasher.update(mv[hashed:done])
                    hashed = done
                    yield done
            if end > hashed:
                mv[base + off + nbytes : end] = bytes(end - base - off - nbytes)
                if hasher is not None:
                    hasher.update(mv[hashed:end])
                hashed = end
        if hasher is not None:
            if hashed < self.nbytes:
                hasher.update(mv[hashed : self.nbytes])
            # only the checksum field: a reader may be parsing the rest of the prelude
            struct.pack_into("<Q", mv, CHECKSUM_OFFSET, hasher.intdigest())
        yield self.nbytes

    @staticmethod
    def _shape(t: TensorLike) -> tuple[int, ...]:
        return tuple(t.shape)

    def to_bytearray(self) -> bytearray:
        out = bytearray(self.nbytes)
        self.pack_into(out)
        return out

    def to_device_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Pack into one ``uint8`` tensor on ``device`` (the tensors' own device by default)."""
        dev = torch.device(device) if device is not None else self._default_device()
        if dev.type == "cpu":
            out = torch.empty(self.nbytes, dtype=torch.uint8)
            self.pack_into(out.numpy())
            return out
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=dev)
        host = bytearray(self.data_start)
        mv = memoryview(host)
        mv[PRELUDE_SIZE : PRELUDE_SIZE + len(self.header)] = self.header
        self._write_prelude(mv, CHECKSUM_NONE, 0)
        out[: self.data_start].copy_(torch.frombuffer(host, dtype=torch.uint8))
        for t, (_dt, shape, off, nbytes) in zip(self.tensors, self.tensor_table):
            if nbytes:
                start = self.data_start + off
                _fill(t, out[start : start + nbytes].view(t.dtype).view(shape))
        for b, (off, nbytes) in zip(self.blobs, self.blob_table):
            start = self.data_start + off
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(b, dtype=torch.uint8)
            out[start : start + nbytes].copy_(src)
        return out

    def _default_device(self) -> torch.device:
        for t in self.tensors:
            return t.device
        return torch.device("cpu")


def _progress(result: Any) -> Iterator[int]:
    """A ``LazyTensor.fill`` result as progress steps (fills may return None or anything else)."""
    return result if isinstance(result, Iterator) else iter(())


def _memmove_ok(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.dtype == dst.dtype
    )


def _write_span(mv: memoryview, start: int, nbytes: int, src: Any) -> Iterator[int]:
    """Copy ``src`` to ``mv[start:start + nbytes]``, yielding the end of each finished step."""
    if isinstance(src, memoryview):
        for pos in range(0, nbytes, PACK_STEP):
            n = min(PACK_STEP, nbytes - pos)
            mv[start + pos : start + pos + n] = src[pos : pos + n]
            yield start + pos + n
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        u8 = torch.frombuffer(mv, dtype=torch.uint8, count=nbytes, offset=start)
    dst = u8.view(src.dtype).view(tuple(src.shape))
    if isinstance(src, LazyTensor):
        last = 0
        for done in _progress(src.fill(dst)):
            last = done
            yield start + done
        if last < nbytes:
            yield start + nbytes
    elif _memmove_ok(src, dst):
        # Plain memmoves: torch's copy_ goes through its intra-op thread pool, which costs
        # milliseconds per call on a busy host for no gain on a contiguous copy.
        s, d = src.data_ptr(), dst.data_ptr()
        for pos in range(0, nbytes, PACK_STEP):
            n = min(PACK_STEP, nbytes - pos)
            ctypes.memmove(d + pos, s + pos, n)
            yield start + pos + n
    else:
        dst.copy_(src)
        yield start + nbytes


def _fill(src: TensorLike, dst: torch.Tensor) -> None:
    if isinstance(src, LazyTensor):
        for _ in _progress(src.fill(dst)):
            pass
    elif _memmove_ok(src, dst):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


def encode(obj: Any) -> Frame:
    """Lay out ``obj`` as a frame (no bytes are copied until ``pack_into``).

    Accepts a ``Frame`` (returned as is), an object with ``to_dict()`` such as
    ``KVCacheTransferData``, or any tree of tensors/bytes/plain values.
    """
    if isinstance(obj, Frame):
        return obj
    if hasattr(obj, "layer_blocks") and callable(getattr(obj, "to_dict", None)):
        obj = obj.to_dict()
    return Frame(obj)


def packed_size(obj: Any) -> int:
    return Frame(obj).nbytes


# -- decoding -------------------------------------------------------------------------


def _ext_hook(code: int, data: bytes) -> Any:
    if code in (EXT_TENSOR, EXT_BLOB) and len(data) == 4:
        return _Ref(code, struct.unpack("<I", data)[0])
    raise KVPayloadError(f"unknown ext type {code} in frame header")


@dataclass
class _Parsed:
    tree: Any
    tensors: list[tuple[torch.dtype, list[int], int, int]]
    blobs: list[tuple[int, int]]
    data_start: int
    total: int


def parse_prelude(head: bytes | memoryview, available: int) -> tuple[int, int, int, int, int]:
    """Validate the prelude; return ``(alg, header_len, data_len, checksum, total)``."""
    if available < PRELUDE_SIZE:
        raise KVPayloadError(
            f"truncated frame: {available} bytes is shorter than the {PRELUDE_SIZE}-byte prelude"
        )
    magic, version, alg, flags, header_len, data_len, checksum = PRELUDE.unpack_from(head, 0)
    if magic != MAGIC:
        raise KVPayloadError(f"not a vllm-omni-kv frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KVPayloadError(
            f"frame format version {version} is not supported (this build reads version "
            f"{VERSION}); upgrade vllm-omni-kv on both stages to the same release"
        )
    if flags:
        raise KVPayloadError(f"frame uses flags {flags:#x} that this build does not understand")
    if alg not in (CHECKSUM_NONE, CHECKSUM_XXH3):
        raise KVPayloadError(f"unknown checksum algorithm {alg}")
    if header_len > MAX_HEADER:
        raise KVPayloadError(f"frame header length {header_len} exceeds the {MAX_HEADER} limit")
    total = align_up(PRELUDE_SIZE + header_len) + data_len
    if total > available:
        raise KVPayloadError(f"truncated frame: header declares {total} bytes, got {available}")
    return alg, header_len, data_len, checksum, total


def _parse(
    head: memoryview,
    available: int,
    *,
    verify: bool,
    region: Callable[[int], Any],
    require_checksum: bool = True,
) -> _Parsed:
    """Validate a frame whose first bytes are ``head`` (at least through the header).

    ``region(total)`` returns the checksummed bytes ``[32, total)`` on demand.
    """
    alg, header_len, data_len, checksum, total = parse_prelude(head, available)
    if head.nbytes < PRELUDE_SIZE + header_len:
        raise KVPayloadError("truncated frame: header extends past the available bytes")
    if verify and alg == CHECKSUM_NONE and require_checksum:
        raise KVPayloadError(
            "frame carries no checksum (it was packed on an accelerator); decode it with "
            "from_bytes_device, or pass verify=False to accept it unverified"
        )
    if verify and alg == CHECKSUM_XXH3:
        got = xxhash.xxh3_64_intdigest(region(total))
        if got != checksum:
            raise KVPayloadError(
                f"frame checksum mismatch (expected {checksum:#018x}, computed {got:#018x}): "
                "the payload was corrupted or overwritten in transit"
            )
    try:
        header = msgpack.unpackb(
            head[PRELUDE_SIZE : PRELUDE_SIZE + header_len],
            ext_hook=_ext_hook,
            strict_map_key=False,
            raw=False,
        )
    except KVPayloadError:
        raise
    except Exception as e:
        raise KVPayloadError(f"frame header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or not {"t", "b", "v"} <= set(header):
        raise KVPayloadError("frame header lacks its 't', 'b' and 'v' fields")
    tensors = check_tensor_table(header["t"], data_len, DTYPES)
    blobs = check_blob_table(header["b"], data_len)
    spans = sorted(
        [(off, nb) for _d, _s, off, nb in tensors if nb] + [(off, nb) for off, nb in blobs if nb]
    )
    for (a_off, a_nb), (b_off, _b_nb) in zip(spans, spans[1:]):
        if b_off < a_off + a_nb:
            raise KVPayloadError(f"overlapping data spans at offsets {a_off} and {b_off}")
    return _Parsed(header["v"], tensors, blobs, align_up(PRELUDE_SIZE + header_len), total)


def _resolve(tree: Any, tensors: Sequence[Any], blobs: Sequence[Any]) -> Any:
    if isinstance(tree, _Ref):
        table = tensors if tree.code == EXT_TENSOR else blobs
        if tree.index >= len(table):
            raise KVPayloadError(f"frame references missing entry #{tree.index}")
        return table[tree.index]
    if isinstance(tree, dict):
        return {k: _resolve(v, tensors, blobs) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_resolve(v, tensors, blobs) for v in tree]
    return tree


def decode(raw: Any, *, verify: bool = True) -> Any:
    """Decode a host frame. Tensors are zero-copy views of ``raw``; byte blobs are copied once.

    The views keep ``raw`` alive. Raises :class:`KVPayloadError` on any defect.
    """
    if isinstance(raw, torch.Tensor):
        return decode_tensor(raw, verify=verify)
    try:
        mv = memoryview(raw).cast("B")
    except TypeError as e:
        raise KVPayloadError(f"cannot read a frame from {type(raw).__name__}: {e}") from None
    p = _parse(mv, mv.nbytes, verify=verify, region=lambda total: mv[PRELUDE_SIZE:total])
    base = p.data_start
    views: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are fine for views
        for dtype, shape, off, nbytes in p.tensors:
            if nbytes == 0:
                views.append(torch.empty(shape, dtype=dtype))
                continue
            u8 = torch.frombuffer(mv, dtype=torch.uint8, count=nbytes, offset=base + off)
            views.append(u8.view(dtype).view(shape))
    blobs = [bytes(mv[base + off : base + off + nb]) for off, nb in p.blobs]
    return _resolve(p.tree, views, blobs)


def decode_tensor(t: torch.Tensor, *, verify: bool = True) -> Any:
    """Decode a frame packed into a ``uint8`` tensor; tensors are views on its device."""
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise KVPayloadError(f"a packed frame tensor is 1-D uint8, got {t.dtype} {tuple(t.shape)}")
    if t.device.type == "cpu":
        return decode(t.contiguous().numpy(), verify=verify)
    n = t.numel()
    prelude = t[: min(n, PRELUDE_SIZE)].cpu().numpy().tobytes()
    _alg, header_len, _dl, _ck, _total = parse_prelude(prelude, n)
    data_start = align_up(PRELUDE_SIZE + header_len)
    head = memoryview(t[:data_start].cpu().numpy().tobytes())
    p = _parse(
        head,
        n,
        verify=verify,
        region=lambda total: t[PRELUDE_SIZE:total].cpu().numpy().tobytes(),
        require_checksum=False,
    )
    views = [
        t[data_start + off : data_start + off + nb].view(dtype).view(shape)
        if nb
        else torch.empty(shape, dtype=dtype, device=t.device)
        for dtype, shape, off, nb in p.tensors
    ]
    blobs = [
        t[data_start + off : data_start + off + nb].cpu().numpy().tobytes() for off, nb in p.blobs
    ]
    return _resolve(p.tree, views, blobs)
