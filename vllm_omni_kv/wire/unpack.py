"""Decoding frames (see :mod:`vllm_omni_kv.wire.codec` for the layout).

:func:`parse` validates prelude and header and returns a :class:`FrameInfo`
(tables, tree, chunk map) without reading data bytes; :func:`materialize`
builds the object with zero-copy tensor views; :func:`decode` does both after
checking every digest (and, given an auth key, every MAC: :func:`authenticate_frame`).
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire import bounded
from vllm_omni_kv.wire.auth import AuthKey, verify_chunk_tag, verify_head_mac
from vllm_omni_kv.wire.device_frames import verify as verify_on_device
from vllm_omni_kv.wire.digests import ChunkMap, Run, verify_chunks
from vllm_omni_kv.wire.digests import verify_head as check_head
from vllm_omni_kv.wire.frame_tables import check_blob_table, check_chunk_bytes, check_tensor_table
from vllm_omni_kv.wire.prelude import (
    CHECKSUM_LINEAR,
    CHECKSUM_NONE,
    CHECKSUM_XXH3,
    DIGEST_ALGS,
    MAX_CHUNK,
    MIN_CHUNK,
    PRELUDE_SIZE,
    Prelude,
    read_prelude,
)

EXT_TENSOR = 1
EXT_BLOB = 2
#: deepest nesting of lists/maps a frame header may hold (KV payloads use a handful)
MAX_DEPTH = 64
#: what validating one tensor or blob table entry allocates (measured: about 270 bytes)
TABLE_ENTRY = 320

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


class _Ref:
    __slots__ = ("code", "index")

    def __init__(self, code: int, index: int) -> None:
        self.code = code
        self.index = index


def _ext_hook(code: int, data: bytes) -> Any:
    if code in (EXT_TENSOR, EXT_BLOB) and len(data) == 4:
        return _Ref(code, struct.unpack("<I", data)[0])
    raise KVPayloadError(f"unknown ext type {code} in frame header")


@dataclass
class FrameInfo:
    """A frame's validated prelude and header: what a reader needs before any data byte."""

    prelude: Prelude
    tree: Any
    tensors: list[tuple[torch.dtype, list[int], int, int]]
    blobs: list[tuple[int, int]]
    chunks: ChunkMap
    #: tensor/blob references in ``tree`` (none: the tree is returned as it is)
    refs: int = 1

    @property
    def data_start(self) -> int:
        return self.prelude.data_start

    @property
    def total(self) -> int:
        return self.prelude.total

    @property
    def has_digests(self) -> bool:
        return self.prelude.alg in DIGEST_ALGS

    def blob_runs(self) -> list[Run]:
        """The chunk runs covering the blobs (decoding copies them, so they must be final)."""
        base = self.data_start
        return self.chunks.runs([(base + off, base + off + nb) for off, nb in self.blobs])


def parse(
    head: memoryview,
    available: int,
    *,
    verify_head: bool = False,
    require_checksum: bool = True,
    auth: AuthKey | None = None,
) -> FrameInfo:
    """Validate prelude and header (``head`` holds at least through the header).

    With ``verify_head`` the prelude checksum is compared over prelude, header and
    trailer, so ``head`` must then hold the trailer too; data chunks are not read. With
    ``verify_head`` and ``require_checksum`` a frame without chunk digests is refused.
    With ``auth`` the frame must be keyed with it and its head MAC is checked before the
    header is decoded (``head`` must hold the trailer). Decoding is bounded
    (:mod:`.bounded`): a header that could take more than 16 MiB + 16 bytes per header
    byte is refused before it is decoded.
    """
    p = _check_head(head, available, verify_head, require_checksum, auth)
    raw = head[PRELUDE_SIZE : PRELUDE_SIZE + p.header_len]
    header, refs, charged = _decode_header(raw)
    if not isinstance(header, dict) or not {"t", "b", "v", "c"} <= set(header):
        raise KVPayloadError("frame header lacks its 't', 'b', 'v' and 'c' fields")
    _check_table_cost(raw, header, charged)
    tensors = check_tensor_table(header["t"], p.data_len, DTYPES)
    blobs = check_blob_table(header["b"], p.data_len)
    chunk_bytes = check_chunk_bytes(header["c"], MIN_CHUNK, MAX_CHUNK)
    spans = sorted(
        [(off, nb) for _d, _s, off, nb in tensors if nb] + [(off, nb) for off, nb in blobs if nb]
    )
    for (a_off, a_nb), (b_off, _b_nb) in zip(spans, spans[1:]):
        if b_off < a_off + a_nb:
            raise KVPayloadError(f"overlapping data spans at offsets {a_off} and {b_off}")
    chunks = ChunkMap(p.data_start, spans, chunk_bytes, p.trailer_start)
    if p.alg != CHECKSUM_NONE and p.digests != chunks.count:
        raise KVPayloadError(
            f"frame trailer holds {p.digests} chunk digests but its spans make "
            f"{chunks.count} chunks of {chunk_bytes} bytes"
        )
    return FrameInfo(p, header["v"], tensors, blobs, chunks, refs)


def _check_head(
    head: memoryview,
    available: int,
    verify_head: bool,
    require_checksum: bool,
    auth: AuthKey | None,
) -> Prelude:
    """The prelude, after the checks of :func:`parse` that read no header object."""
    p = read_prelude(head, available)
    if head.nbytes < PRELUDE_SIZE + p.header_len:
        raise KVPayloadError("truncated frame: header extends past the available bytes")
    if verify_head and p.alg == CHECKSUM_NONE and require_checksum:
        raise KVPayloadError(
            "frame carries no checksum (its producer packed it with checksum=False, e.g. "
            "frame_checksum: false) and this reader requires chunk digests: pack it with "
            "digests, or read it unverified (verify=False; a pull backend's consumer: "
            "require_digests: false)"
        )
    if (verify_head and p.alg != CHECKSUM_NONE) or (auth is not None and p.keyed):
        if head.nbytes < p.total:
            raise KVPayloadError("truncated frame: the digest trailer is not available")
        check_head(head, p)
    if auth is not None:
        verify_head_mac(head, p, auth)
    return p


def _decode_header(raw: memoryview) -> tuple[Any, int, int]:
    """The header's tree (nesting checked), how many tensor/blob references it holds and
    the charge it was decoded under (:func:`.bounded.unpack_charged`)."""
    refs = 0

    def count_refs(code: int, data: bytes) -> Any:
        nonlocal refs
        refs += 1
        return _ext_hook(code, data)

    try:
        header, charged = bounded.unpack_charged(raw, ext_hook=count_refs)
    except KVPayloadError:
        raise
    except bounded.UnpackLimitError as e:
        raise KVPayloadError(
            f"frame header refused: {e}; not a vllm-omni-kv payload (a producer that sends "
            "large metadata of many tiny lists, maps or strings: send it as bytes or a tensor)"
        ) from None
    except Exception as e:
        raise KVPayloadError(f"frame header is not valid msgpack: {e}") from None
    _check_depth(header)
    return header, refs, charged


def _check_table_cost(raw: memoryview, header: dict[Any, Any], charged: int) -> None:
    """Refuse tables whose validation (:data:`TABLE_ENTRY` bytes an entry) would take the
    parse past :func:`.bounded.limit` of the header's size."""
    entries = sum(len(header[k]) for k in ("t", "b") if isinstance(header[k], list))
    need, cap = TABLE_ENTRY * entries, bounded.limit(raw.nbytes)
    if charged + need > cap and bounded.FAST_RATE * raw.nbytes <= cap:
        try:  # a small header was admitted at its worst case: count what it holds
            charged = bounded.charge(bytes(raw), 1 << 62)
        except ValueError:
            pass
    if charged + need > cap:
        raise KVPayloadError(
            f"frame header refused: its {entries} tensor and blob entries and its objects "
            f"could take more than {cap} bytes ({bounded.LIMIT_BASE} + {bounded.LIMIT_RATE} "
            "per header byte): not a vllm-omni-kv payload (a producer packs one tensor per "
            "layer and cache)"
        )


def _check_depth(tree: Any) -> None:
    """Refuse headers nested deeper than :data:`MAX_DEPTH` (checked without recursion, so
    later recursive walks of the tree stay far from Python's recursion limit). Walks
    one level at a time: ``level`` holds the lists/maps at depth ``depth``. msgpack
    gives plain ``dict`` and ``list`` containers, so exact type tests suffice."""
    level = [tree] if type(tree) is dict or type(tree) is list else []
    depth = 0
    while level:
        if depth >= MAX_DEPTH:
            raise KVPayloadError(
                f"frame header nests lists/maps deeper than {MAX_DEPTH} levels: not a "
                "vllm-omni-kv payload"
            )
        below: list[Any] = []
        for node in level:
            for c in node.values() if type(node) is dict else node:
                kind = type(c)
                if kind is list or kind is dict:
                    below.append(c)
        level, depth = below, depth + 1


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


def materialize(mv: memoryview, info: FrameInfo) -> Any:
    """The object of a parsed frame: tensors are zero-copy views of ``mv`` (valid once
    their bytes are), byte blobs are copied now (so their chunks must be final)."""
    base = info.data_start
    if not info.tensors and not info.blobs:  # a header-only frame (a shared-pages payload)
        return _resolve(info.tree, [], []) if info.refs else info.tree
    views: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are fine for views
        for dtype, shape, off, nbytes in info.tensors:
            if nbytes == 0:
                views.append(torch.empty(shape, dtype=dtype))
                continue
            u8 = torch.frombuffer(mv, dtype=torch.uint8, count=nbytes, offset=base + off)
            views.append(u8.view(dtype).view(shape))
    blobs = [bytes(mv[base + off : base + off + nb]) for off, nb in info.blobs]
    return _resolve(info.tree, views, blobs) if info.refs else info.tree


def _as_bytes(raw: Any) -> memoryview:
    try:
        return memoryview(raw).cast("B")
    except TypeError as e:
        raise KVPayloadError(f"cannot read a frame from {type(raw).__name__}: {e}") from None


def authenticate_frame(raw: Any, auth: AuthKey) -> FrameInfo:
    """Check a whole host frame's checksum, head MAC and every chunk tag against ``auth``.

    Raises :class:`KVPayloadError` for an unkeyed frame or any MAC that does not match.
    """
    mv = _as_bytes(raw)
    info = parse(mv, mv.nbytes, verify_head=True, require_checksum=False, auth=auth)
    for k, s, e in info.chunks.iter_bounds(0, info.chunks.count):
        verify_chunk_tag(mv, info.prelude.tags_start, k, s, e, auth)
    return info


def decode(
    raw: Any, *, verify: bool = True, auth: AuthKey | None = None, require_digests: bool = True
) -> Any:
    """Decode a host frame. Tensors are zero-copy views of ``raw``; byte blobs are copied once.

    With ``verify`` the prelude checksum and every chunk digest are checked (a frame
    without digests is refused unless ``require_digests`` is False); with
    ``auth`` the frame must be keyed with it and every MAC is checked too (without
    ``auth`` a keyed frame is decoded unauthenticated: readers that require
    authentication use :meth:`~.stream.PayloadStream.authenticate`). The views keep
    ``raw`` alive. Raises :class:`KVPayloadError` on any defect.
    """
    if isinstance(raw, torch.Tensor):
        return decode_tensor(raw, verify=verify, auth=auth, require_digests=require_digests)
    mv = _as_bytes(raw)
    if auth is not None:  # a keyed frame always has its digests and checksum
        info = authenticate_frame(mv, auth)
    else:
        info = parse(mv, mv.nbytes, verify_head=verify, require_checksum=require_digests)
    if verify and info.has_digests:
        verify_chunks(mv, info.chunks, info.chunks.runs(None), info.prelude.alg)
    return materialize(mv, info)


def decode_tensor(
    t: torch.Tensor,
    *,
    verify: bool = True,
    auth: AuthKey | None = None,
    require_digests: bool = True,
) -> Any:
    """Decode a frame packed into a ``uint8`` tensor; tensors are views on its device.

    ``verify``: check the frame's digests (linear digests on its device, xxh3 on the
    host); ``require_digests``: with ``verify``, refuse a frame without digests.
    """
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise KVPayloadError(f"a packed frame tensor is 1-D uint8, got {t.dtype} {tuple(t.shape)}")
    if t.device.type == "cpu":
        return decode(
            t.contiguous().numpy(), verify=verify, auth=auth, require_digests=require_digests
        )
    t = t.contiguous()
    if auth is not None:
        authenticate_frame(t.cpu().numpy(), auth)
    n = t.numel()
    p = read_prelude(t[: min(n, PRELUDE_SIZE)].cpu().numpy().tobytes(), n)
    on_host = verify and p.alg == CHECKSUM_XXH3  # xxh3 digests are checked on the host
    head = t[: p.total if on_host else p.data_start].cpu().numpy().tobytes()
    check = verify and p.alg != CHECKSUM_LINEAR
    info = parse(memoryview(head), n, verify_head=check, require_checksum=require_digests)
    if on_host:
        verify_chunks(memoryview(head), info.chunks, info.chunks.runs(None), p.alg)
    elif verify and p.alg == CHECKSUM_LINEAR:
        verify_on_device(t, head, info.chunks, p)
    data_start = info.data_start
    views = [
        t[data_start + off : data_start + off + nb].view(dtype).view(shape)
        if nb
        else torch.empty(shape, dtype=dtype, device=t.device)
        for dtype, shape, off, nb in info.tensors
    ]
    blobs = [
        t[data_start + off : data_start + off + nb].cpu().numpy().tobytes()
        for off, nb in info.blobs
    ]
    return _resolve(info.tree, views, blobs)
