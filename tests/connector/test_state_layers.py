"""Recurrent-state layers (Mamba / GDN) of a hybrid model through the worker halves, on
emulated caches: one full-attention layer (``vllm_omni_kv.testing.layout_emulator``, vLLM's
CPU layout) and two gated-delta-net layers, each a ``[blocks, 1, 1, C]`` int8 page view
as vLLM 0.32 registers it, in a ``KVCacheConfig`` of vLLM's own specs.

References: vLLM's rule that the state after ``T`` tokens lives in block
``(T - 1) // block_size`` of the state group's table, and the bytes written there.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _kv_fixtures import load_and_wait

pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from vllm_omni_kv.connector.config import parse_omni_kv_config  # noqa: E402
from vllm_omni_kv.connector.engine_layout import EngineLayout  # noqa: E402
from vllm_omni_kv.connector.metadata import LoadSpec, OmniKVConnectorMetadata, SaveSpec  # noqa: E402
from vllm_omni_kv.connector.state_layers import state_specs  # noqa: E402
from vllm_omni_kv.connector.worker import OmniKVWorker  # noqa: E402
from vllm_omni_kv.errors import ConfigError, KVPayloadError  # noqa: E402
from vllm_omni_kv.kvcache.state_pages import StateLayoutId  # noqa: E402
from vllm_omni_kv.testing import fake_backend  # noqa: E402
from vllm_omni_kv.testing.layout_emulator import (  # noqa: E402
    EmulatedEngine,
    build_caches,
    read_tokens,
    reference_tokens,
    write_tokens,
)

BS, BLOCKS, SEQ = 32, 12, 150  # 5 attention blocks; the state after 150 tokens: block 4
ATTN = EmulatedEngine(backend="CPU_ATTN", layout="LBHNC", dtype="bfloat16", num_layers=1,
                      num_blocks=BLOCKS, block_size=BS)  # fmt: skip
STATES = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
ATTN_NAME = ATTN.layer_names()[0]
SHAPES = ((3, 384), (1, 128, 128))  # conv (state_len, dim), GDN (v heads, v dim, k dim)
STATE_BYTES = (3 * 384 + 128 * 128) * 4
PAGE = 2 * BS * 2 * 32 * 2  # one attention block: 2 heads of 32, K and V, bfloat16
DIGEST = "d1"
# the tables at save / load time, one per transfer group (state groups first, as vLLM
# orders Qwen3-Next's), "align" mode: the state block at (SEQ - 1) // BS, nulls before it
SRC = [[0, 0, 0, 0, 3], [0, 0, 0, 0, 5], [1, 2, 4, 6, 7]]
DST = [[0, 0, 0, 0, 9], [0, 0, 0, 0, 11], [2, 4, 6, 8, 10]]

fake_backend.register_fake_backend()


def _kv_cache_config(ssm_dtype: torch.dtype) -> KVCacheConfig:
    mamba = MambaSpec(block_size=BS, shapes=SHAPES, dtypes=(torch.float32, ssm_dtype),
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")  # fmt: skip
    attn = FullAttentionSpec(BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec([n], mamba) for n in STATES]
    groups.append(KVCacheGroupSpec([ATTN_NAME], attn))
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _state_views(content: int) -> dict[str, torch.Tensor]:
    """Each state layer's ``[blocks, 1, 1, C]`` int8 view of its own padded pages."""
    out = {}
    for n in STATES:
        raw = torch.zeros(BLOCKS, 1, 1, content + 512, dtype=torch.int8)
        out[n] = raw[..., :content]
    return out


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"st{uuid.uuid4().hex[:10]}"
    yield name
    fake_backend.clear(name)


def _worker(ns: str, kcc: KVCacheConfig, conv: str = "SD", **extra: Any) -> OmniKVWorker:
    cfg = parse_omni_kv_config(
        {
            "backend": "shm",
            "backend_extra": {"namespace": ns},
            "recv_timeout": 10,
            "transfer_cpus": "inherit",
            **extra,
        }  # fmt: skip
    )
    cache = SimpleNamespace(block_size=BS, mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto")
    vllm_config = SimpleNamespace(cache_config=cache)
    states = {
        n: (StateLayoutId(**{**ident.__dict__, "conv_layout": conv}), bs)
        for n, (ident, bs) in state_specs(vllm_config, kcc).items()
    }
    facts = EngineLayout(block_size=BS, layout="LBHNC", backend="CPU_ATTN", states=states)
    return OmniKVWorker(vllm_config, cfg, f"e-{uuid.uuid4().hex[:6]}", kcc, engine=facts)


def _caches(kcc: KVCacheConfig) -> dict[str, torch.Tensor]:
    content = kcc.kv_cache_groups[0].kv_cache_spec.state_content_size_bytes
    return {**_state_views(content), ATTN_NAME: build_caches(ATTN)[ATTN_NAME]}


def _transfer(ns: str, src: KVCacheConfig, dst: KVCacheConfig, dst_conv: str = "SD") -> Any:
    """Save ``SEQ`` tokens plus states from a producer, load them into a consumer."""
    producer, consumer = _worker(ns, src), _worker(ns, dst, dst_conv)
    pc, cc = _caches(src), _caches(dst)
    try:
        producer.register_kv_caches(pc)
        consumer.register_kv_caches(cc)
        ref = reference_tokens(ATTN, SEQ, seed=3)
        write_tokens(ATTN, {ATTN_NAME: pc[ATTN_NAME]}, SRC[2], ref)
        g = torch.Generator().manual_seed(5)
        for i, n in enumerate(STATES):
            pc[n].view(BLOCKS, -1)[SRC[i][-1]] = torch.randint(
                -128, 127, (pc[n].shape[-1],), generator=g, dtype=torch.int8
            )
        save = SaveSpec("req", "tid", SRC[2], SEQ, DIGEST, group_block_ids=SRC)
        producer.wait_for_save(OmniKVConnectorMetadata(saves=[save]))
        load = LoadSpec("req", "tid", DST[2], 0, SEQ, SEQ, DIGEST, group_block_ids=DST)
        meta = load_and_wait(consumer, load)
        assert meta is not None
        producer.get_transfer_results({"req"})
        return meta.loads["req"], ref, pc, cc
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_state_pages_and_attention_pages_round_trip(ns: str) -> None:
    kcc = _kv_cache_config(torch.float32)
    out, ref, pc, cc = _transfer(ns, kcc, _kv_cache_config(torch.float32))
    assert out["ok"], out["error"]
    assert out["tokens"] == SEQ
    for i, n in enumerate(STATES):  # the state block, byte for byte; no other block written
        src, dst = pc[n].view(BLOCKS, -1), cc[n].view(BLOCKS, -1)
        assert torch.equal(dst[DST[i][-1]], src[SRC[i][-1]]), n
        assert int(dst.count_nonzero(dim=1).bool().sum()) == 1, n
    (rk, rv), = ref  # fmt: skip
    (gk, gv), = read_tokens(ATTN, {ATTN_NAME: cc[ATTN_NAME]}, DST[2], SEQ)  # fmt: skip
    assert torch.equal(gk, rk) and gv is not None and rv is not None and torch.equal(gv, rv)
    # whole attention pages, one state page per state layer, and the frame's metadata
    rest = out["bytes"] - 5 * PAGE - len(STATES) * STATE_BYTES
    assert 0 < rest < 16384, out


@pytest.mark.parametrize(
    ("dst_ssm", "dst_conv", "what"),
    [(torch.float16, "SD", "float16"), (torch.float32, "DS", "conv layout DS")],
)
def test_a_different_state_identity_is_refused(
    ns: str, dst_ssm: torch.dtype, dst_conv: str, what: str
) -> None:
    """A consumer whose SSM state dtype or conv state layout differs refuses the payload
    (vLLM then recomputes) and writes nothing."""
    out, _ref, _pc, cc = _transfer(ns, _kv_cache_config(torch.float32),
                                   _kv_cache_config(dst_ssm), dst_conv)  # fmt: skip
    assert not out["ok"]
    assert "state" in out["error"] and what in out["error"], out["error"]
    for n in STATES:
        assert int(cc[n].count_nonzero()) == 0, n


def test_state_layers_need_equal_tp_sizes(ns: str) -> None:
    kcc = _kv_cache_config(torch.float32)
    w = _worker(ns, kcc, target_tp_size=2)
    try:
        with pytest.raises(ConfigError, match="recurrent state"):
            w.register_kv_caches(_caches(kcc))
    finally:
        w.shutdown()


def test_state_layout_identity_round_trips_and_rejects_malformed() -> None:
    ident = StateLayoutId(SHAPES, ("float32", "float32"), "GDN_ATTN", "SD", "auto", "float32")
    assert StateLayoutId.of(ident.to_dict()) == ident
    assert ident.content_bytes == STATE_BYTES
    for bad in (None, {"shapes": [[3, 384]]}, {**ident.to_dict(), "dtypes": ["float32"]}):
        with pytest.raises(KVPayloadError):
            StateLayoutId.of(bad)


def test_the_producer_prefills_all_but_the_last_token_once() -> None:
    """A producer's request of a model with state layers loses its last prompt token and
    generates one token (its state after ``N - 1`` tokens is what a consumer loads); a
    second call (a preempted request scheduled again) changes nothing."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_omni_kv.connector.state_layers import (
        payload_tokens,
        state_backoff,
        truncate_for_save,
    )

    kcc = _kv_cache_config(torch.float32)
    backoff = state_backoff(kcc)
    assert backoff == 1
    sp = SamplingParams(
        max_tokens=16, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    req = Request("r", list(range(10, 20)), sp, None)
    for _ in range(2):
        truncate_for_save(req, backoff)
        assert req.prompt_token_ids == list(range(10, 19))
        assert req.num_prompt_tokens == 9 and req.num_tokens == 9 and req.max_tokens == 1
    assert payload_tokens(10, backoff) == 9 and payload_tokens(1, backoff) == 0
    plain = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                          kv_cache_groups=kcc.kv_cache_groups[-1:])  # fmt: skip
    assert state_backoff(plain) == 0 and payload_tokens(10, 0) == 10
