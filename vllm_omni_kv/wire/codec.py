"""The packed frame: how every object crosses a process boundary (no pickle).

Layout (little endian, format version 2)::

    offset 0   prelude, 32 bytes (see :mod:`.prelude`)
               magic b"OMKV" | u16 version | u8 checksum_alg | u8 flags
               | u32 header_len | u64 data_len | u64 checksum | u32 digests
    offset 32  header: msgpack map {"t": tensors, "b": blobs, "v": tree, "c": chunk_bytes}
               tensors: [[dtype, shape, offset, nbytes], ...]
               blobs:   [[offset, nbytes], ...]
               tree:    the object itself; tensors and large byte strings are
                        msgpack ext refs (code 1 / 2, u32 index) into the tables
    data_start = align_up(32 + header_len, 64)
               raw tensor / blob bytes, each span 64-byte aligned (offsets are
               relative to data_start)
    trailer_start = data_start + data_len
               ``digests`` u64 xxh3-64 digests, one per chunk (see :mod:`.digests`)
    total      = trailer_start + 8 * digests

Each data span is cut into chunks of ``chunk_bytes`` from its own offset; the
prelude checksum (``checksum_alg == 1``) covers prelude, header and trailer, so
a reader verifies exactly the chunks it reads. Frames packed on an accelerator
carry ``checksum_alg == 2``: their digests are the linear digest of
:mod:`.linear_digest`, computed there with torch ops. Frames packed with
``checksum=False`` carry ``checksum_alg == 0`` and no digests (readers refuse them
unless told not to verify).

A frame packed with an auth key (:mod:`.auth`) sets ``FLAG_MAC`` in the prelude
and always carries digests; its trailer continues with a 16-byte keyed BLAKE2b
tag per chunk and a 32-byte keyed BLAKE2b MAC over prelude, header, digests and
tags (the prelude checksum covers those too)::

    trailer_start + 8 * digests    chunk tags, 16 bytes each
    head_mac_start                 head MAC, 32 bytes
    total = head_mac_start + 32
"""

from __future__ import annotations

import ctypes
import math
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire.auth import AuthKey, head_mac
from vllm_omni_kv.wire.device_frames import seal
from vllm_omni_kv.wire.digests import ChunkMap, ChunkWriter, head_digest
from vllm_omni_kv.wire.prelude import (
    ALIGN,
    CHECKSUM_LINEAR,
    CHECKSUM_NONE,
    CHECKSUM_OFFSET,
    CHECKSUM_XXH3,
    DIGEST_SIZE,
    FLAG_MAC,
    HEAD_MAC_SIZE,
    MAGIC,
    MAX_CHUNK,
    MIN_CHUNK,
    PACK_STEP,
    PRELUDE,
    PRELUDE_SIZE,
    TAG_SIZE,
    VERSION,
    Prelude,
    align_up,
    read_prelude,
)
from vllm_omni_kv.wire.unpack import (
    DTYPE_NAMES,
    DTYPES,
    EXT_BLOB,
    EXT_TENSOR,
    decode,
    decode_tensor,
    parse,
)

__all__ = [
    "ALIGN",
    "CHECKSUM_NONE",
    "CHECKSUM_OFFSET",
    "CHECKSUM_XXH3",
    "MAGIC",
    "PACK_STEP",
    "PRELUDE",
    "PRELUDE_SIZE",
    "VERSION",
    "DTYPES",
    "DTYPE_NAMES",
    "EXT_TENSOR",
    "Frame",
    "LazyTensor",
    "align_up",
    "decode",
    "decode_tensor",
    "encode",
    "parse",
    "read_prelude",
]

#: byte strings at least this long travel as raw blobs instead of inside the header
BLOB_MIN = 1024


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
    #: told the destination of this tensor in a frame before any tensor of that frame is
    #: filled (a source that fills several tensors with one copy learns where each goes)
    place: Callable[[torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


TensorLike = torch.Tensor | LazyTensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Frame:
    """An object laid out for packing; ``nbytes`` is known before any copy.

    ``chunk_bytes`` (default :data:`PACK_STEP`) is the size of one digested chunk;
    a caller that reads whole paged blocks passes the bytes of one block, so a
    block range is exactly a run of chunks. With ``auth`` the frame is keyed: it
    always carries digests (``checksum=False`` is ignored) plus chunk tags and a MAC.
    """

    def __init__(
        self, obj: Any, chunk_bytes: int | None = None, auth: AuthKey | None = None
    ) -> None:
        self.auth = auth
        self.chunk_bytes = PACK_STEP if chunk_bytes is None else int(chunk_bytes)
        if not MIN_CHUNK <= self.chunk_bytes <= MAX_CHUNK:
            raise KVPayloadError(
                f"chunk_bytes must be in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk_bytes!r}"
            )
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
            {"t": tensor_table, "b": blob_table, "v": tree, "c": self.chunk_bytes},
            use_bin_type=True,
        )
        self.tensor_table = tensor_table
        self.blob_table = blob_table
        self.data_start = align_up(PRELUDE_SIZE + len(self.header))
        self.data_len = off
        #: data spans ``(offset, nbytes, source)`` in offset order
        self._spans: list[tuple[int, int, Any]] = [
            (o, nb, t) for t, (_d, _s, o, nb) in zip(self.tensors, tensor_table)
        ] + [(o, nb, b) for b, (o, nb) in zip(self.blobs, blob_table)]
        self.chunks = ChunkMap(
            self.data_start,
            [(o, nb) for o, nb, _src in self._spans],
            self.chunk_bytes,
            self.data_start + self.data_len,
        )
        count = self.chunks.count
        macs = (TAG_SIZE * count + HEAD_MAC_SIZE) if auth is not None else 0
        #: size of the frame with its digest trailer (what ``pack_into`` writes by default)
        self.nbytes = self.data_start + self.data_len + DIGEST_SIZE * count + macs
        #: size of the frame packed with ``checksum=False`` (no trailer; a keyed frame
        #: always has its trailer)
        self.plain_nbytes = self.nbytes if auth is not None else self.data_start + self.data_len

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
    def _write_head(self, mv: memoryview, alg: int) -> None:
        digests = self.chunks.count if alg != CHECKSUM_NONE else 0
        flags = FLAG_MAC if self.auth is not None and alg == CHECKSUM_XXH3 else 0
        PRELUDE.pack_into(
            mv, 0, MAGIC, VERSION, alg, flags, len(self.header), self.data_len, 0, digests
        )
        h_end = PRELUDE_SIZE + len(self.header)
        mv[PRELUDE_SIZE:h_end] = self.header
        mv[h_end : self.data_start] = bytes(self.data_start - h_end)

    def pack_into(self, buf: Any, *, checksum: bool = True) -> int:
        """Write the frame into a writable host buffer (bytearray, mmap, ...); return its size
        (``nbytes``, or ``plain_nbytes`` with ``checksum=False``)."""
        for _ in self.iter_pack(buf, checksum=checksum):
            pass
        return self.nbytes if checksum else self.plain_nbytes

    def iter_pack(self, buf: Any, *, checksum: bool = True) -> Iterator[int]:
        """Write the frame step by step, yielding how many leading bytes are final.

        The first value is ``data_start`` (prelude and header written, the prelude's
        checksum still 0); then one value per packed step: every chunk below it has
        its digest in the trailer already, so a reader may verify and use it at once;
        the last is the frame's size, yielded after the checksum is in place.
        """
        checksum = checksum or self.auth is not None
        size = self.nbytes if checksum else self.plain_nbytes
        mv = memoryview(buf).cast("B")
        if mv.readonly:
            raise KVPayloadError("pack_into needs a writable buffer")
        if mv.nbytes < size:
            raise KVPayloadError(f"buffer of {mv.nbytes} bytes cannot hold a {size}-byte frame")
        alg = CHECKSUM_XXH3 if checksum else CHECKSUM_NONE
        self._write_head(mv, alg)
        self._place(lambda start, nbytes, t: _host_view(mv, start, nbytes, t))
        yield self.data_start
        base = self.data_start
        flags = FLAG_MAC if self.auth is not None else 0
        p = Prelude(alg, len(self.header), self.data_len, 0, self.chunks.count, flags)
        writer = (
            ChunkWriter(mv, self.chunk_bytes, p.trailer_start, self.auth, p.tags_start)
            if checksum
            else None
        )
        # copy steps end on chunk boundaries when chunks are small, so each is hashed whole
        c = self.chunk_bytes
        step = c * (PACK_STEP // c) if c <= PACK_STEP else PACK_STEP
        last = base
        spans = self._spans
        for i, (off, nbytes, src) in enumerate(spans):
            end = base + (spans[i + 1][0] if i + 1 < len(spans) else self.data_len)
            if nbytes:
                if writer is not None:
                    writer.span(base + off, nbytes)
                for done in _write_span(mv, base + off, nbytes, src, step):
                    ready = done if writer is None else writer.advance(done)
                    if ready > last:
                        last = ready
                        yield ready
                if writer is not None:
                    writer.advance(base + off + nbytes)
            if end > base + off + nbytes:  # padding: covered by no digest
                mv[base + off + nbytes : end] = bytes(end - base - off - nbytes)
        if checksum:
            if self.auth is not None:  # before the checksum, which covers it
                mac = head_mac(mv, p, self.auth)
                mv[p.head_mac_start : p.head_mac_start + HEAD_MAC_SIZE] = mac
            # only the checksum field: a reader may be parsing the rest of the prelude
            struct.pack_into("<Q", mv, CHECKSUM_OFFSET, head_digest(mv, p))
        yield size

    def to_bytearray(self) -> bytearray:
        out = bytearray(self.nbytes)
        self.pack_into(out)
        return out

    def to_device_tensor(
        self,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
        *,
        on_device: bool = False,
    ) -> torch.Tensor:
        """Pack into one ``uint8`` tensor on ``device`` (the tensors' own device by default),
        or into ``out`` (a ``uint8`` tensor of at least the frame's size, e.g. a pool block:
        the data is copied once, straight into it); returns the packed bytes.

        On an accelerator (or with ``on_device``: torch ops on any device) the frame carries
        linear chunk digests computed there (:mod:`.device_frames`); keyed frames are
        packed on the host.
        """
        if out is not None:
            device = out.device
        dev = torch.device(device) if device is not None else self._default_device()
        if (dev.type == "cpu" and not on_device) or self.auth is not None:
            host_frame = torch.empty(self.nbytes, dtype=torch.uint8)
            self.pack_into(host_frame.numpy())
            if out is None:
                return host_frame.to(dev)
            out[: self.nbytes].copy_(host_frame)
            return out[: self.nbytes]
        size = self.nbytes
        if out is None:
            out = torch.empty(size, dtype=torch.uint8, device=dev)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < size:
            raise KVPayloadError(f"a {size}-byte frame needs a 1-D uint8 tensor of that size")
        out = out[:size]
        out.zero_()
        host = bytearray(self.data_start)
        self._write_head(memoryview(host), CHECKSUM_LINEAR)
        out[: self.data_start].copy_(torch.frombuffer(host, dtype=torch.uint8))
        frame = out
        self._place(
            lambda start, nbytes, t: frame[start : start + nbytes].view(t.dtype).view(t.shape)
        )
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
        seal(out, host, self.chunks)
        return out

    def _place(self, view: Callable[[int, int, LazyTensor], torch.Tensor]) -> None:
        """Tell each lazy tensor that asks where it goes (``view(start, nbytes, t)``)."""
        for off, nbytes, src in self._spans:
            if isinstance(src, LazyTensor) and src.place is not None and nbytes:
                src.place(view(self.data_start + off, nbytes, src))

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


def _host_view(mv: memoryview, start: int, nbytes: int, src: Any) -> torch.Tensor:
    """``mv[start:start + nbytes]`` as a tensor of the dtype and shape of ``src``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        u8 = torch.frombuffer(mv, dtype=torch.uint8, count=nbytes, offset=start)
    return u8.view(src.dtype).view(tuple(src.shape))


def _write_span(
    mv: memoryview, start: int, nbytes: int, src: Any, step: int = PACK_STEP
) -> Iterator[int]:
    """Copy ``src`` to ``mv[start:start + nbytes]``, yielding the end of each finished step."""
    if isinstance(src, memoryview):
        for pos in range(0, nbytes, step):
            n = min(step, nbytes - pos)
            mv[start + pos : start + pos + n] = src[pos : pos + n]
            yield start + pos + n
        return
    dst = _host_view(mv, start, nbytes, src)
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
        for pos in range(0, nbytes, step):
            n = min(step, nbytes - pos)
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


def encode(obj: Any, chunk_bytes: int | None = None, auth: AuthKey | None = None) -> Frame:
    """Lay out ``obj`` as a frame (no bytes are copied until ``pack_into``).

    Accepts a ``Frame`` (returned as is), an object with ``to_dict()`` such as
    ``KVCacheTransferData``, or any tree of tensors/bytes/plain values.
    ``chunk_bytes`` is the bytes covered by one digest (default :data:`PACK_STEP`);
    ``auth`` keys the frame (chunk tags and a head MAC, see :mod:`.auth`).
    """
    if isinstance(obj, Frame):
        return obj
    if hasattr(obj, "layer_blocks") and callable(getattr(obj, "to_dict", None)):
        obj = obj.to_dict()
    return Frame(obj, chunk_bytes, auth)
