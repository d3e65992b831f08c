"""vLLM 0.32's paged KV cache layouts and the layout identity a paged-blocks payload carries.

vLLM hands a connector one 4-D view per layer, logically ``[blocks, kv_heads,
block_size, C]``, whose physical order is the group's ``KVCacheLayout`` (a stride
permutation of ``[L, B, H, N, C]``, RFC #42082). What ``C`` holds depends on the
attention backend (the *packing*):

* ``k_v`` (FlashAttention, FlashInfer, Triton): per token and head, K then V
  (``C = 2 * head_size``; backends read ``view.transpose(1, 2).split(head_size, -1)``).
* ``kt_v`` (vLLM's CPU backend, LBHNC only): per block and head, K transposed
  (``[head_size, block_size]``) then V (``[block_size, head_size]``).
* ``latent`` (MLA): one latent vector per token (``kv_heads == 1``, ``C`` its width).
* ``packed``: an opaque cell per (head slot, token) whose meaning only the backend knows
  (NVFP4, TurboQuant, per-token-head scales, separate K/V planes; vLLM's KV cache spec
  says so). Its pages are copied byte for byte between engines of the same backend and
  identity, never converted, and have no per-token K/V view.

When the attention kernel uses smaller blocks than the block manager, a manager
block is ``ratio`` kernel blocks in a row (dim 0 of the view counts kernel blocks).

A *page* is one manager block of one layer. A payload carries pages in the
producer's intra-block order (``HNC`` or ``NHC``) plus a :class:`KVLayoutId`, so a
consumer copies pages byte for byte when both identities agree on everything that
gives the bytes their meaning, converts them through token views when they differ
losslessly (``kt_v`` and ``k_v``, ``HNC`` and ``NHC``, other kernel blocks), and
refuses otherwise (other dtype, heads, head size or block size; packed pages that are not
the same bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from vllm_omni_kv.errors import ConfigError, KVPayloadError

#: vLLM 0.32's ``KVCacheLayout`` members: stride permutation of logical ``[L, B, H, N, C]``
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: vLLM's legacy names (``VLLM_KV_CACHE_LAYOUT`` accepts them too)
LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}
PACKINGS = ("k_v", "kt_v", "latent", "packed")
#: packings whose ``C`` is one cell of ``head_size`` elements (no separate K and V)
CELL_PACKINGS = ("latent", "packed")
#: attention backends whose ``C`` is not K|V per token
BACKEND_PACKING = {"CPU_ATTN": "kt_v"}
FP8_NAMES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layout_name(name: str) -> str:
    """The ``KVCacheLayout`` member name for ``name`` (legacy ``NHD``/``HND`` accepted)."""
    canon = LAYOUT_ALIASES.get(name, name)
    if canon not in LAYOUT_ORDERS:
        raise ConfigError(
            f"unknown KV cache layout {name!r}: use one of {', '.join(LAYOUT_ORDERS)} "
            "(or NHD / HND)"
        )
    return canon


def page_order(layout: str) -> str:
    """``"HNC"`` or ``"NHC"``: the order of heads and tokens inside one block."""
    order = LAYOUT_ORDERS[layout_name(layout)]
    return "HNC" if order.index(2) < order.index(3) else "NHC"


def dtype_name(dtype: torch.dtype, cache_dtype: str | None = None) -> str:
    """The identity's dtype: vLLM's ``cache_dtype`` when set (fp8 caches may be stored
    as uint8), else the tensor's dtype."""
    if cache_dtype and cache_dtype != "auto":
        return FP8_NAMES.get(cache_dtype, cache_dtype)
    name = str(dtype).removeprefix("torch.")
    return {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(name, name)


@dataclass(frozen=True)
class KVLayoutId:
    """What the bytes of one layer's paged cache mean (equal for every layer of an engine)."""

    packing: str
    layout: str
    dtype: str
    block_size: int  # tokens per manager block
    kernel_block_size: int  # tokens per attention-kernel block (divides block_size)
    kv_heads: int
    head_size: int  # K (and V) width per head; the latent (MLA) or cell (packed) width
    element_size: int
    backend: str = ""  # the attention backend's name (reported, not compared)

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ConfigError(f"unknown KV packing {self.packing!r}: one of {PACKINGS}")
        object.__setattr__(self, "layout", layout_name(self.layout))
        if min(self.block_size, self.kernel_block_size, self.kv_heads, self.head_size) < 1:
            raise ConfigError(f"KV layout sizes must be positive: {self}")
        if self.block_size % self.kernel_block_size:
            raise ConfigError(
                f"kernel block size {self.kernel_block_size} does not divide the block size "
                f"{self.block_size}"
            )
        if self.packing == "kt_v" and self.layout != "LBHNC":
            raise ConfigError(f"vLLM's CPU packing exists only in LBHNC, not {self.layout}")
        if self.packing == "latent" and self.kv_heads != 1:
            raise ConfigError("an MLA latent cache has one KV head")

    @property
    def ratio(self) -> int:
        """Kernel blocks per manager block."""
        return self.block_size // self.kernel_block_size

    @property
    def content(self) -> int:
        """Elements of ``C``, the last axis of vLLM's view."""
        return self.head_size if self.packing in CELL_PACKINGS else 2 * self.head_size

    @property
    def page_order(self) -> str:
        return page_order(self.layout)

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """One page in physical order: ``[ratio, H, N, C]`` or ``[ratio, N, H, C]``."""
        h, n, c = self.kv_heads, self.kernel_block_size, self.content
        return (self.ratio, h, n, c) if self.page_order == "HNC" else (self.ratio, n, h, c)

    @property
    def page_bytes(self) -> int:
        r, a, b, c = self.page_shape
        return r * a * b * c * self.element_size

    def describe(self) -> str:
        who = f"{self.backend} " if self.backend else ""
        return (
            f"{who}{self.packing} {self.layout} {self.dtype}, block {self.block_size} "
            f"(kernel {self.kernel_block_size}), {self.kv_heads} kv heads x {self.head_size}"
        )

    def same_pages(self, other: KVLayoutId) -> bool:
        """True when a page of ``other`` means the same as one of ours, byte for byte."""
        mine, theirs = asdict(self), asdict(other)
        for k in ("layout", "backend"):
            mine.pop(k)
            theirs.pop(k)
        return mine == theirs and (self.page_order == other.page_order or self.kv_heads == 1)

    def conversion_refusal(self, other: KVLayoutId) -> str | None:
        """Why pages of ``other`` cannot be converted into ours losslessly (None: they can)."""
        for what in ("dtype", "element_size", "kv_heads", "head_size", "block_size"):
            if getattr(self, what) != getattr(other, what):
                return f"{what} differs ({getattr(other, what)} vs {getattr(self, what)})"
        if (self.packing == "latent") != (other.packing == "latent"):
            return "an MLA latent cache and a K/V cache hold different things"
        if "packed" in (self.packing, other.packing) and (
            self.packing != other.packing
            or self.backend != other.backend
            or not self.same_pages(other)
        ):
            return (
                "packed (quantized or backend-packed) pages are copied only byte for byte, "
                "between engines with the same attention backend, cache dtype, intra-block "
                "order, heads and block sizes"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KVLayoutId:
        kinds = _field_kinds(cls)
        if not isinstance(d, dict) or not set(kinds) - {"backend"} <= d.keys():
            raise KVPayloadError(f"paged-blocks payload has no valid layout identity: {d!r}")
        for k, kind in kinds.items():
            if k in d and (type(d[k]) is not kind):
                raise KVPayloadError(
                    f"paged-blocks payload layout identity field {k!r} is not a {kind.__name__}: "
                    f"{d[k]!r}"
                )
        known = {k: v for k, v in d.items() if k in kinds}  # str and int values: hashable
        key = (cls, tuple(known.items()))
        hit = _IDENTS.get(key)
        if hit is not None:
            return hit
        try:
            ident = cls(**known)
        except (ConfigError, TypeError) as e:
            raise KVPayloadError(f"paged-blocks payload layout identity is invalid: {e}") from None
        if len(_IDENTS) >= 64:
            _IDENTS.clear()
        _IDENTS[key] = ident
        return ident


#: identities read by ``KVLayoutId.from_dict``, by their fields (frozen values: shared)
_IDENTS: dict[tuple[type, tuple[tuple[str, Any], ...]], KVLayoutId] = {}


def _field_kinds(cls: type[KVLayoutId]) -> dict[str, type]:
    """``{field: str or int}`` of the identity's fields (computed once)."""
    kinds = _KINDS.get(cls)
    if kinds is None:
        kinds = _KINDS[cls] = {f.name: str if f.type == "str" else int for f in fields(cls)}
    return kinds


_KINDS: dict[type, dict[str, type]] = {}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as a same-size integer dtype (copies and index ops exist for every one)."""
    return t.view(_BITS[t.element_size()])


def check_view(view: torch.Tensor, ident: KVLayoutId, what: str = "KV cache") -> None:
    """Raise ``ConfigError`` unless ``view`` is vLLM's 4-D view of a cache of ``ident``."""
    want = (ident.kv_heads, ident.kernel_block_size, ident.content)
    if view.dim() != 4 or tuple(view.shape[1:]) != want:
        raise ConfigError(
            f"{what}: expected vLLM's [blocks, {want[0]}, {want[1]}, {want[2]}] view for "
            f"{ident.describe()}, got {tuple(view.shape)}"
        )
    if view.shape[0] % ident.ratio or view.element_size() != ident.element_size:
        raise ConfigError(
            f"{what}: {tuple(view.shape)} {view.dtype} does not fit {ident.describe()}"
        )
    h, n = view.stride(1), view.stride(2)
    if view.shape[1] > 1 and view.shape[2] > 1 and (h > n) != (ident.page_order == "HNC"):
        raise ConfigError(
            f"{what}: the view's strides {view.stride()} are not in {ident.layout} order "
            f"({ident.page_order} inside a block): the engine's KV cache layout is not the "
            "one the connector was told"
        )


def page_view(view: torch.Tensor, ident: KVLayoutId) -> torch.Tensor:
    """``[manager blocks, *ident.page_shape]``: a strided view of the cache, pages in
    physical order."""
    pv = view if ident.page_order == "HNC" else view.transpose(1, 2)
    return pv.unflatten(0, (-1, ident.ratio))


def logical_from_pages(pages: torch.Tensor, ident: KVLayoutId) -> torch.Tensor:
    """vLLM's logical ``[kernel blocks, H, N, C]`` view of pages ``[n, *page_shape]``."""
    flat = pages.flatten(0, 1)
    return flat if ident.page_order == "HNC" else flat.transpose(1, 2)


def token_views(view: torch.Tensor, ident: KVLayoutId) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V as ``[kernel blocks, kernel block size, H, head_size]`` views of vLLM's
    logical view (``V`` is None for an MLA latent cache, whose "K" is the latent)."""
    if ident.packing == "latent":
        return view.transpose(1, 2), None
    if ident.packing == "packed":
        raise ConfigError(f"{ident.describe()}: packed cache cells have no per-token K/V view")
    if ident.packing == "k_v":
        t = view.transpose(1, 2)
        d = ident.head_size
        return t[..., :d], t[..., d:]
    # kt_v: per (block, head), K^T [D, N] (one row per channel, for the vec/vec16 kernels'
    # vectorised q.k) then V [N, D]; checked against a live vLLM 0.32 CPU engine in
    # tests/kvcache/test_cpu_layout.py (the amx kernel is not covered)
    nb, h, n, c = view.shape
    d = c // 2
    try:
        halves = view.view(nb, h, 2, n * d)
    except RuntimeError as e:
        raise ConfigError(f"a CPU-packed KV cache must be dense per block and head: {e}") from e
    key = halves[:, :, 0].unflatten(2, (d, n)).permute(0, 3, 1, 2)
    value = halves[:, :, 1].unflatten(2, (n, d)).permute(0, 2, 1, 3)
    return key, value


def block_token_views(
    view: torch.Tensor, ident: KVLayoutId
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V as ``[manager blocks, ratio, kernel block size, H, head_size]`` views."""
    k, v = token_views(view, ident)
    return k.unflatten(0, (-1, ident.ratio)), None if v is None else v.unflatten(
        0, (-1, ident.ratio)
    )


def block_kv(view: torch.Tensor, ident: KVLayoutId) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V as ``[manager blocks, block_size, H, head_size]`` views, or None where the
    layout has no such view (MLA, packed; kernel blocks that split a head-major block)."""
    if ident.packing == "packed":
        return None
    k, v = block_token_views(view, ident)
    if v is None:
        return None
    shape = (k.shape[0], ident.block_size, *k.shape[3:])
    try:
        return k.view(shape), v.view(shape)
    except RuntimeError:
        return None


def dense_pages(pv: torch.Tensor, host: bool = True) -> bool:
    """True when each page of ``pv`` (a :func:`page_view`) is one run of host memory (of
    memory on any device, with ``host=False``)."""
    if host and not pv.is_cpu:
        return False
    if pv.is_contiguous():
        return True
    shape, stride = pv.shape, pv.stride()
    expect = 1
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1 and stride[i] != expect:
            return False
        expect *= shape[i]
    return True


def infer_identity(
    view: torch.Tensor, *, packing: str | None = None, block_size: int | None = None
) -> KVLayoutId:
    """The identity of a bare 4-D cache whose engine did not say (vLLM-free callers).

    Packing defaults to the CPU backend's on a CPU tensor and to K|V per token on a
    GPU; the layout is read from the strides (LBHNC or LBNHC).
    """
    if view.dim() != 4:
        raise KVPayloadError(
            f"paged-blocks payloads need vLLM's 4-D [blocks, heads, block_size, C] view, got "
            f"{tuple(view.shape)}: use the token-major format"
        )
    pk = packing or ("kt_v" if view.device.type == "cpu" else "k_v")
    nk, h, n, c = view.shape
    hnc = h == 1 or n == 1 or view.stride(1) > view.stride(2)
    return KVLayoutId(
        packing=pk,
        layout="LBHNC" if hnc else "LBNHC",
        dtype=dtype_name(view.dtype),
        block_size=int(block_size or n),
        kernel_block_size=int(n),
        kv_heads=int(h),
        head_size=int(c if pk in CELL_PACKINGS else c // 2),
        element_size=view.element_size(),
    )
