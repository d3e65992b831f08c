"""The tiny hybrid models with recurrent-state layers that the P/D tests run, what each keeps
per request, and how their loads and tokens are checked (``test_pd_state``,
``test_serve_state``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from _models import tiny_granite_hybrid, tiny_lfm2, tiny_qwen3_next

#: bytes a load moves besides its pages: a packed frame's header and digests, or a one-copy
#: payload's descriptor (region, geometry, block ids, digests); 1.3-1.6 KB measured for
#: these prompts on every transport, far below one more page (the smallest here: a
#: 67,840-byte state page)
FRAME_OVERHEAD = 24576
#: a reference step whose two best logprobs are this close is a near tie, and the tokens
#: from it on are not compared: the consumer's kernels (its last prompt token runs as a
#: one-token step from the loaded state, the reference's inside a chunk) round differently
#: in bfloat16, and the difference grows over the decode. test_serve_state compares every
#: token, against vLLM computing the same split
NEAR_TIE = 0.03


@dataclass(frozen=True)
class Hybrid:
    """What one model keeps per request: ``attention`` layers of ``page`` bytes per block of
    ``block_size`` tokens (vLLM picks the power of two that makes a page hold a state
    page), and
    ``states`` layers of one ``state`` page each (conv state then SSM / GDN state)."""

    build: Any
    dtype: str
    block_size: int
    attention: int
    page: int
    states: int
    state: int
    #: None: vLLM's default (on: "align" mode); False: "none" mode, one state block
    prefix_caching: bool | None = None
    #: the prefix-hit test's prompt seed (its reference's first tokens are no near ties)
    prefix_seed: int = 11


MODELS = {
    # GDN (vLLM's CPU kernel needs bfloat16): conv (3, 384) bfloat16 + state (1 head, 128,
    # 128) float32; attention: 2 heads of 64, bfloat16
    "qwen3_next": Hybrid(
        tiny_qwen3_next, "bfloat16", 256, 1, 256 * 2 * 2 * 64 * 2, 3, 3 * 384 * 2 + 128**2 * 4
    ),
    # Mamba2: conv (3, 128 + 2 * 64) + state (4 heads, 32, 64), float32; attention: 2 of 32
    # vLLM 0.32's CPU Mamba2 kernel fails in "align" mode (IndexError in mamba_mixer2's
    # conv_ssm_forward, colocated too), so this model runs without prefix caching
    "granite": Hybrid(
        tiny_granite_hybrid,
        "float32",
        128,
        1,
        128 * 2 * 2 * 32 * 4,
        3,
        (3 * 256 + 4 * 32 * 64) * 4,
        prefix_caching=False,
    ),  # fmt: skip
    # LFM2's gated short convolutions: one conv state (2, 256) float32 per layer (vLLM's
    # SHORT_CONV); attention: 2 KV heads of 64, float32
    "lfm2": Hybrid(
        tiny_lfm2, "float32", 128, 1, 128 * 2 * 2 * 64 * 4, 3, 2 * 256 * 4, prefix_seed=17
    ),
}


def same_up_to_near_tie(tokens: list[int], ref: tuple[list[int], int]) -> bool:
    """``tokens`` are the reference's up to its first near tie."""
    want, decided = ref
    return len(tokens) == len(want) and tokens[:decided] == want[:decided]


def check_state_load_bytes(m: Hybrid, load: dict[str, Any], n: int, local: int) -> None:
    """A load of tokens ``[local, n - 1)``: every attention layer's pages of the blocks
    after the local prefix, one state page per state layer, and the frame's overhead."""
    blocks = math.ceil((n - 1) / m.block_size) - local // m.block_size
    rest = load["bytes"] - m.attention * blocks * m.page - m.states * m.state
    assert 0 < rest < FRAME_OVERHEAD, (n, local, load)
