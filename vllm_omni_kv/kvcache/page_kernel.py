"""One Triton launch for a whole device move: every layer's pages through a layer table.

The device mover's fast path where Triton and a CUDA cache are present: one program per
(layer, page pair) and chunk of ``BLOCK`` words copies that chunk, reading the layer's
source and destination base addresses, page strides and page size from small tables,
so a move of any number of layers and pages is one launch and one upload of its
tables (the pattern of SGLang's ``transfer_kv_all_layer`` and of the reference kernel
measured in ``shared/gpu-results/2026-11-27-h200``). Pages must be dense with byte
strides (every page one run of memory); anything else takes the per-layer gather and
scatter. Triton is imported on first use only; with ``TRITON_INTERPRET=1`` set before
then the same kernel runs on host tensors (how the tests check its bytes without a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from vllm_omni_kv.kvcache.cache_layout import dense_pages
from vllm_omni_kv.kvcache.move_plan import MovePlan
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: words each program copies
BLOCK = 2048


@functools.cache
def _kernel() -> Any:
    """The jitted kernel (None without Triton)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # the layer count and the items' address (5 * layers words into the table) are not
    # specialized on, so one compiled variant per word width serves every move
    @triton.jit(do_not_specialize=["n_layers", "items"])  # type: ignore[misc]
    def copy_pages(table, n_layers, items, WORD: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: N803
        item = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        layer = tl.load(items + item)
        per = tl.load(table + 4 * n_layers + layer)  # the layer's page, in words
        if start < per:
            src = tl.load(table + layer).to(tl.pointer_type(WORD))
            dst = tl.load(table + n_layers + layer).to(tl.pointer_type(WORD))
            s = tl.load(items + tl.num_programs(0) + item) * tl.load(table + 2 * n_layers + layer)
            d = tl.load(items + 2 * tl.num_programs(0) + item) * tl.load(
                table + 3 * n_layers + layer
            )
            offs = start + tl.arange(0, BLOCK)
            mask = offs < per
            tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)

    return copy_pages


class KernelFailed(Exception):
    """The kernel could not be compiled or launched; it is off from now on (the mover
    takes its per-layer gathers and scatters)."""


#: why the kernel is off in this process (None: it is not)
_off: str | None = None


def usable(plan: MovePlan, device: torch.device) -> bool:
    """Whether :func:`launch` can move ``plan`` on ``device``: Triton present and working,
    a CUDA device (or the interpreter), and every moved page dense with byte strides."""
    if _off is not None or (device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    layers = [i for g in plan.groups for i in g.layers]
    for i in layers:
        for pv in (plan.src[i], plan.dst[i]):
            if pv.device != device or not dense_pages(pv, host=False):
                return False
    return bool(layers) and _kernel() is not None


def _word(plan: MovePlan, layers: list[int]) -> int:
    """The widest word every address, stride and page size of the move is a multiple of."""
    values = [plan.page_bytes(i) for i in layers]
    for i in layers:
        for pv in (plan.src[i], plan.dst[i]):
            values += [pv.data_ptr(), pv.stride(0) * pv.element_size()]
    return next(w for w in (8, 4, 2, 1) if all(v % w == 0 for v in values))


#: :func:`tables`' result: the host table, layers, items, word bytes
Tables = tuple[torch.Tensor, int, int, int]


def tables(plan: MovePlan, device: torch.device) -> Tables:
    """``(one int64 tensor on the host: the layer table then the items, layers, items,
    word bytes)``: per layer source / destination address, page strides and page size
    in words; per (layer, pair) its layer, source page and destination page."""
    layers = sorted({i for g in plan.groups for i in g.layers})
    word = _word(plan, layers)
    row = {layer: k for k, layer in enumerate(layers)}
    table = [plan.src[i].data_ptr() for i in layers] + [plan.dst[i].data_ptr() for i in layers]
    table += [plan.src[i].stride(0) * plan.src[i].element_size() // word for i in layers]
    table += [plan.dst[i].stride(0) * plan.dst[i].element_size() // word for i in layers]
    table += [plan.page_bytes(i) // word for i in layers]
    # per group, its layers times its pairs, built with tensor ops (not per page in Python)
    ids = plan.host_ids()
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for g in plan.groups:
        a, b = g.span
        rows = torch.tensor([row[i] for i in g.layers], dtype=torch.int64)
        parts.append(
            (
                rows.repeat_interleave(b - a),
                ids[0, a:b].repeat(len(rows)),
                ids[1, a:b].repeat(len(rows)),
            )
        )
    items = sum(len(p[0]) for p in parts)
    pin = device.type == "cuda" and torch.cuda.is_available()
    host = torch.empty(len(table) + 3 * items, dtype=torch.int64, pin_memory=pin)
    host[: len(table)] = torch.tensor(table, dtype=torch.int64)
    for k in range(3):  # the items' layers, then source pages, then destination pages
        torch.cat(
            [p[k] for p in parts], out=host[len(table) + k * items : len(table) + (k + 1) * items]
        )
    return host, len(layers), items, word


def launch(plan: MovePlan, host: torch.Tensor, layers: int, items: int, word: int) -> None:
    """Upload the tables (one copy) and launch the kernel once, on the calling thread's
    current stream of the plan's device."""
    device = plan.dst[plan.groups[0].layers[0]].device
    up = host if device.type == "cpu" else host.to(device, non_blocking=True)
    per = max(plan.page_bytes(i) for g in plan.groups for i in g.layers) // word
    grid = (items, -(-per // BLOCK))
    try:
        _kernel()[grid](up, layers, up[5 * layers :], WORD=_tl_word(word), BLOCK=BLOCK)
    except Exception as e:  # compiling (no compiler, an unsupported card) or launching
        turn_off(f"{type(e).__name__}: {e}")
        raise KernelFailed(str(e)) from None


def turn_off(why: str) -> None:
    """Stop using the kernel in this process (logged once)."""
    global _off
    if _off is None:
        logger.warning(
            "the Triton page kernel is off (%s): device moves take per-layer gathers and scatters",
            why,
        )
    _off = why


def warm_up(device: torch.device) -> bool:
    """Compile the kernel now and check it moves exact bytes (two pages of two layers on
    ``device``), so that no load pays for the compile; False (the kernel off) where it
    cannot. Call at start, where the device caches are registered."""
    src = [torch.arange(512, dtype=torch.int64, device=device).view(2, 256) for _ in range(2)]
    dst = [torch.zeros(2, 256, dtype=torch.int64, device=device) for _ in range(2)]
    plan = MovePlan.whole(src, dst, [(0, 1), (1, 0)])
    if not usable(plan, device):
        return False
    try:
        launch(plan, *tables(plan, device))
    except KernelFailed:
        return False
    if not all(torch.equal(d, s.flip(0)) for s, d in zip(src, dst, strict=True)):
        turn_off("it moved wrong bytes in its warm-up")
        return False
    return True


def _tl_word(word: int) -> Any:
    import triton.language as tl

    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}[word]
