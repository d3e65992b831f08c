"""Extract / inject one request's KV from / into paged cache blocks.

``blocks`` is a ``[num_blocks, block_size, num_kv_heads, head_dim]`` view as
returned by :func:`vllm_omni_kv.kvcache.kv_utils.normalize_layer_kv` (it may be
non-contiguous, e.g. for the CPU layout).  Each call moves the bytes exactly
once: full blocks with one ``index_select`` / ``index_copy_``, the partial tail
block with one ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_omni_kv.errors import KVPayloadError

BlockIds = Sequence[int] | torch.Tensor


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no CPU kernel for fp8; same-size integer views move the same bytes.
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def _check_blocks(blocks: torch.Tensor) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 4:
        shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise KVPayloadError(
            f"blocks must be a [num_blocks, block_size, heads, dim] tensor, got {shape}"
        )


def _used_ids(blocks: torch.Tensor, block_ids: BlockIds, seq_len: int) -> tuple[torch.Tensor, int]:
    """Validate and return (ids of the blocks that hold ``seq_len`` tokens, count)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise KVPayloadError(f"seq_len must be an int >= 0, got {seq_len!r}")
    num_blocks, block_size = blocks.shape[0], blocks.shape[1]
    if block_size < 1:
        raise KVPayloadError("blocks have block_size 0")
    needed = -(-seq_len // block_size)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.is_complex():
            raise KVPayloadError("block_ids tensor must be 1-D with an integer dtype")
        ids = block_ids.to(device=blocks.device, dtype=torch.long)
    else:
        try:
            ids = torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=blocks.device)
        except (TypeError, ValueError) as exc:
            raise KVPayloadError(f"block_ids must be integers: {exc}") from exc
    if ids.numel() < needed:
        raise KVPayloadError(
            f"seq_len {seq_len} needs {needed} blocks of {block_size} tokens, "
            f"only {ids.numel()} block ids given"
        )
    ids = ids[:needed]
    if needed:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise KVPayloadError(f"block id out of range [0, {num_blocks}): min {lo}, max {hi}")
    return ids, needed


def request_kv_shape(blocks: torch.Tensor, seq_len: int) -> tuple[int, int, int]:
    """Shape ``(seq_len, num_kv_heads, head_dim)`` of one request's KV in ``blocks``."""
    _check_blocks(blocks)
    return (int(seq_len), int(blocks.shape[2]), int(blocks.shape[3]))


def gather_request_kv(
    blocks: torch.Tensor,
    block_ids: BlockIds,
    seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy the first ``seq_len`` tokens held in ``block_ids`` into ``[seq_len, h, d]``.

    ``out`` (contiguous, same dtype/device as ``blocks``) receives the data
    when given, e.g. a view into a shared-memory segment; otherwise a new
    tensor is allocated.  Returns the filled tensor.
    """
    _check_blocks(blocks)
    ids, needed = _used_ids(blocks, block_ids, seq_len)
    _, bs, h, d = blocks.shape
    shape = (seq_len, h, d)
    if out is None:
        out = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    else:
        if tuple(out.shape) != shape:
            raise KVPayloadError(f"out has shape {tuple(out.shape)}, expected {shape}")
        if out.dtype != blocks.dtype:
            raise KVPayloadError(f"out dtype {out.dtype} != cache dtype {blocks.dtype}")
        if out.device != blocks.device:
            raise KVPayloadError(f"out device {out.device} != cache device {blocks.device}")
        if not out.is_contiguous():
            raise KVPayloadError("out must be contiguous")
    full = seq_len // bs
    tail = seq_len - full * bs
    src, dst = _byte_view(blocks), _byte_view(out)
    if full:
        torch.index_select(src, 0, ids[:full], out=dst[: full * bs].view(full, bs, h, d))
    if tail:
        dst[full * bs :].copy_(src[int(ids[needed - 1])][:tail])
    return out


def scatter_request_kv(blocks: torch.Tensor, block_ids: BlockIds, src: torch.Tensor) -> None:
    """Write ``src`` (``[seq_len, h, d]``) into the token slots of ``block_ids``.

    Inverse of :func:`gather_request_kv`; writes through ``blocks`` (a view)
    into the underlying cache.  The block ids used must be distinct.
    """
    _check_blocks(blocks)
    if not isinstance(src, torch.Tensor) or src.dim() != 3:
        raise KVPayloadError("src must be a [seq_len, heads, dim] tensor")
    _, bs, h, d = blocks.shape
    seq_len = int(src.shape[0])
    if tuple(src.shape[1:]) != (h, d):
        raise KVPayloadError(f"src heads/dim {tuple(src.shape[1:])} != cache {(h, d)}")
    if src.dtype != blocks.dtype:
        raise KVPayloadError(f"src dtype {src.dtype} != cache dtype {blocks.dtype}")
    ids, needed = _used_ids(blocks, block_ids, seq_len)
    if needed and torch.unique(ids).numel() != needed:
        raise KVPayloadError("block_ids used for one request must be distinct")
    if src.device != blocks.device:
        src = src.to(blocks.device)
    full = seq_len // bs
    tail = seq_len - full * bs
    dst, source = _byte_view(blocks), _byte_view(src)
    if full:
        chunks = source[: full * bs].reshape(full, bs, h, d)
        if dst.is_contiguous():
            dst.index_copy_(0, ids[:full], chunks)
        else:
            # Strided (e.g. vLLM's head-major CPU) caches: per-block copies measure ~3x
            # faster than index_copy_ into a permuted view.
            for j, b in enumerate(ids[:full].tolist()):
                dst[b].copy_(chunks[j])
    if tail:
        dst[int(ids[needed - 1])][:tail].copy_(source[full * bs :])


def scatter_checked(
    blocks: torch.Tensor, ids: torch.Tensor, tail_block: int, src: torch.Tensor
) -> None:
    """:func:`scatter_request_kv` without a host wait, for a device cache: ``ids`` are on
    the device of ``blocks`` and were checked on the host (distinct, in range, one per
    block of ``src``'s rows); ``tail_block`` holds a partial last block's rows. ``src``
    crosses to the device without waiting (the caller waits once per move)."""
    _, bs, h, d = blocks.shape
    rows = int(src.shape[0])
    full, tail = rows // bs, rows % bs
    if src.device != blocks.device:
        src = src.to(blocks.device, non_blocking=True)
    dst, source = _byte_view(blocks), _byte_view(src)
    if full:
        dst.index_copy_(0, ids[:full], source[: full * bs].reshape(full, bs, h, d))
    if tail:
        dst[tail_block][:tail].copy_(source[full * bs :])
