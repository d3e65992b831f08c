"""A registered memory pool and its allocator, shared by the transfer-engine backends.

One pool per connector (per process in practice): a single large ``uint8``
tensor registered once with the transfer engine. Buffers handed out of it are
``ManagedBuffer`` views; the allocator is first-fit over a sorted free list,
coalesces neighbours on free, and refuses double / overlapping / foreign frees
loudly instead of corrupting its bookkeeping.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, NoReturn

import torch

from vllm_omni_kv.closing import Closing
from vllm_omni_kv.errors import ConfigError, KVPayloadError, KVTransferError


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


#: dimensions a received buffer's shape may have at most (torch's own limit is 64)
MAX_DIMS = 64


class BufferAllocator:
    """First-fit allocator over ``[0, pool_size)`` with ``alignment``-aligned blocks.

    Thread-safe. ``alloc`` returns an offset; ``free`` takes it back. Sizes are
    rounded up to the alignment so every block (and therefore every offset)
    stays aligned.
    """

    def __init__(self, pool_size: int, alignment: int = 4096) -> None:
        if not isinstance(pool_size, int) or pool_size <= 0:
            raise ConfigError(f"pool_size must be a positive int, got {pool_size!r}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment!r}")
        self.alignment = alignment
        # usable size: whole aligned blocks only
        self.pool_size = pool_size - pool_size % alignment
        if self.pool_size == 0:
            raise ConfigError(f"pool_size {pool_size} is smaller than the alignment {alignment}")
        self._lock = threading.Lock()
        self._free_offsets: list[int] = [0]  # sorted
        self._free_sizes: dict[int, int] = {0: self.pool_size}
        self._allocated: dict[int, int] = {}  # offset -> rounded size

    # -- queries -------------------------------------------------------------------
    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._allocated.values())

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_sizes.values())

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max(self._free_sizes.values(), default=0)

    @property
    def num_allocations(self) -> int:
        with self._lock:
            return len(self._allocated)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Snapshot of the free list as ``[(offset, size), ...]`` sorted by offset."""
        with self._lock:
            return [(o, self._free_sizes[o]) for o in self._free_offsets]

    # -- alloc / free --------------------------------------------------------------
    def alloc(self, size: int) -> int:
        """Reserve ``size`` bytes; raise ``KVTransferError`` when no free block is large enough."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"allocation size must be a positive int, got {size!r}")
        need = _align_up(size, self.alignment)
        with self._lock:
            for off in self._free_offsets:
                avail = self._free_sizes[off]
                if avail < need:
                    continue
                del self._free_sizes[off]
                idx = bisect.bisect_left(self._free_offsets, off)
                if avail == need:
                    self._free_offsets.pop(idx)
                else:
                    self._free_offsets[idx] = off + need
                    self._free_sizes[off + need] = avail - need
                self._allocated[off] = need
                return off
            largest = max(self._free_sizes.values(), default=0)
            free_total = sum(self._free_sizes.values())
        raise KVTransferError(
            f"memory pool exhausted: cannot allocate {size} bytes ({need} aligned); "
            f"pool {self.pool_size} bytes, {free_total} free, largest free block {largest} bytes. "
            "Raise memory_pool_size, release ManagedBuffers after use, or cleanup() "
            "requests that were never pulled."
        )

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; double or foreign frees raise ``KVTransferError``."""
        with self._lock:
            size = self._allocated.pop(offset, None)
            if size is None:
                self._raise_bad_free(offset)
            idx = bisect.bisect_left(self._free_offsets, offset)
            start, end = offset, offset + size
            # coalesce with the following free block
            if idx < len(self._free_offsets) and self._free_offsets[idx] == end:
                end += self._free_sizes.pop(self._free_offsets[idx])
                self._free_offsets.pop(idx)
            # coalesce with the preceding free block
            if idx > 0:
                prev = self._free_offsets[idx - 1]
                if prev + self._free_sizes[prev] == start:
                    self._free_sizes[prev] += end - start
                    return
            self._free_offsets.insert(idx, start)
            self._free_sizes[start] = end - start

    def _raise_bad_free(self, offset: int) -> NoReturn:
        # called with the lock held: explain what the offset actually is
        if not 0 <= offset < self.pool_size:
            raise KVTransferError(
                f"free of offset {offset}: outside this pool [0, {self.pool_size}); "
                "the buffer belongs to another pool"
            )
        idx = bisect.bisect_right(self._free_offsets, offset) - 1
        if idx >= 0:
            fo = self._free_offsets[idx]
            if fo <= offset < fo + self._free_sizes[fo]:
                raise KVTransferError(
                    f"double free: offset {offset} lies in free block "
                    f"[{fo}, {fo + self._free_sizes[fo]}); was it released twice?"
                )
        for a_off, a_size in self._allocated.items():
            if a_off < offset < a_off + a_size:
                raise KVTransferError(
                    f"overlapping free: offset {offset} is inside allocated block "
                    f"[{a_off}, {a_off + a_size}); free the block by its start offset {a_off}"
                )
        raise KVTransferError(f"free of offset {offset}: not the start of any allocated block")


class ManagedBuffer(Closing):
    """A block of a :class:`MemoryPool`; release it (or use ``with``) when done.

    Dropping a ManagedBuffer without ``release()`` does not free its block (tensor
    views of it may still be alive): the pool would leak, as ``health()`` shows.
    """

    def __init__(self, pool: MemoryPool, offset: int, size: int) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size
        self._released = False
        self._lock = threading.Lock()
        #: set on buffers returned by a receiver when the sender put a tensor
        self.dtype_name: str | None = None
        self.shape: list[int] | None = None

    @property
    def released(self) -> bool:
        return self._released

    @property
    def address(self) -> int:
        """Absolute address of the first byte (what the transfer engine wants)."""
        return self.pool.base_ptr + self.offset

    @property
    def tensor(self) -> torch.Tensor:
        """A ``uint8`` view of exactly ``size`` bytes of the pool (no copy)."""
        if self._released:
            raise KVTransferError(
                f"ManagedBuffer at offset {self.offset} was released; its memory may be reused"
            )
        return self.pool.tensor[self.offset : self.offset + self.size]

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """View the first bytes as ``dtype`` with ``shape`` (no copy)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = itemsize
        for d in shape:
            n *= int(d)
        if n > self.size:
            raise ValueError(
                f"shape {tuple(shape)} of {dtype} needs {n} bytes; buffer has {self.size}"
            )
        if self.offset % itemsize:
            raise ValueError(f"offset {self.offset} is not aligned for {dtype}")
        return self.tensor[:n].view(dtype).view(tuple(shape))

    def to_tensor(self) -> torch.Tensor:
        """A view with the dtype/shape the sender put (``uint8`` bytes when it put bytes).
        They come from the sender: a dtype this build does not know, or a shape that is not
        a list of non-negative integers fitting in the buffer, is a ``KVPayloadError``."""
        if self.dtype_name is None or self.shape is None:
            return self.tensor
        from vllm_omni_kv.wire.codec import DTYPES

        name, shape = self.dtype_name, self.shape
        dtype = DTYPES.get(name) if type(name) is str else None
        dims = shape if type(shape) in (list, tuple) and len(shape) <= MAX_DIMS else None
        if dtype is None or dims is None or any(type(d) is not int or d < 0 for d in dims):
            raise KVPayloadError(f"a received buffer described as {name!r} {shape!r}: not a tensor")
        try:
            return self.as_tensor(dtype, dims)  # checks the bytes it needs against the buffer
        except ValueError as e:
            raise KVPayloadError(
                f"a received buffer described as {name} {list(dims)}: {e}"
            ) from None

    def release(self) -> None:
        """Give the block back to the pool; later calls are no-ops."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self.pool.allocator.free(self.offset)

    def close(self) -> None:
        """Same as :meth:`release` (so ``with buffer:`` releases it)."""
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"ManagedBuffer(offset={self.offset}, size={self.size}, {state})"


def resolve_pool_device(name: Any) -> torch.device:
    """``cpu`` (default), ``cuda[:N]`` or ``npu[:N]`` (Ascend, needs torch_npu); a missing
    accelerator is a ConfigError."""
    text = str(name or "cpu")
    kind = text.split(":", 1)[0]
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"memory_pool_device={name!r} needs torch_npu (Ascend); use 'cpu' here"
            ) from None
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(
            f"memory_pool_device must be 'cpu', 'cuda[:N]' or 'npu[:N]', got {name!r}"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type in ("cuda", "npu"):
        backend = getattr(torch, dev.type, None)
        if backend is None or not backend.is_available():
            raise ConfigError(
                f"memory_pool_device={name!r} names an accelerator that is not available "
                "here; use memory_pool_device='cpu'"
            )
        return dev
    raise ConfigError(f"memory_pool_device must be 'cpu', 'cuda[:N]' or 'npu[:N]', got {name!r}")


class MemoryPool:
    """One contiguous ``uint8`` tensor plus its allocator.

    Host pools are pinned when CUDA is available (faster H2D/D2H), plain CPU
    memory otherwise; ``device='cuda:N'`` allocates the pool on that GPU.
    """

    def __init__(self, size: int, device: Any = "cpu", alignment: int = 4096) -> None:
        self.device = resolve_pool_device(device)
        self.allocator = BufferAllocator(int(size), alignment=alignment)
        self.size = self.allocator.pool_size
        if self.device.type == "cpu":
            pinned = torch.cuda.is_available()
            t = torch.empty(self.size, dtype=torch.uint8, pin_memory=pinned)
            self.pinned = pinned
        else:
            t = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            self.pinned = False
        self.tensor = t
        self.base_ptr: int = int(t.data_ptr())

    def alloc(self, size: int) -> ManagedBuffer:
        off = self.allocator.alloc(size)
        return ManagedBuffer(self, off, size)

    def owns(self, buf: Any) -> bool:
        return isinstance(buf, ManagedBuffer) and buf.pool is self

    def stats(self) -> dict[str, Any]:
        return {
            "pool_size": self.size,
            "pool_device": str(self.device),
            "pinned": self.pinned,
            "used_bytes": self.allocator.used,
            "free_bytes": self.allocator.free_bytes,
            "largest_free_block": self.allocator.largest_free,
            "live_buffers": self.allocator.num_allocations,
        }
