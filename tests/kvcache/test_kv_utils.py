"""Tests for vllm_omni_kv.kvcache.kv_utils: TP routing, keys, ports, merge/slice, layouts."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_kv import kv_utils as public
from vllm_omni_kv.errors import ConfigError, KVPayloadError
from vllm_omni_kv.kvcache.kv_utils import (
    KV_LAYOUTS,
    KV_ZMQ_PORT_OFFSET,
    KVTPTopology,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    detect_kv_layout,
    get_kv_connector_key,
    get_kv_source_ranks,
    get_kv_target_ranks,
    get_local_tp_rank,
    get_omni_replica_id,
    get_tp_world_size,
    kv_zmq_port,
    merge_received_rank_shards,
    normalize_layer_kv,
    slice_kv_tensor_heads,
    slice_layer_blocks,
    slice_received_rank_shard,
    validate_kv_tp_topology,
)

# --------------------------------------------------------------------------- topology


def targets(src: int, dst: int, rank: int) -> list[int]:
    return get_kv_target_ranks(KVTPTopology(src, dst, rank))


def sources(src: int, dst: int, rank: int) -> list[int]:
    return get_kv_source_ranks(KVTPTopology(src, dst, rank))


@pytest.mark.parametrize(
    ("src", "dst", "expect_targets", "expect_sources"),
    [
        (1, 1, [[0]], [[0]]),
        (2, 1, [[0], [0]], [[0, 1]]),
        (1, 2, [[0, 1]], [[0], [0]]),
        (4, 2, [[0], [0], [1], [1]], [[0, 1], [2, 3]]),
        (2, 4, [[0, 1], [2, 3]], [[0], [0], [1], [1]]),
        (2, 2, [[0], [1]], [[0], [1]]),
    ],
)
def test_rank_mapping(
    src: int, dst: int, expect_targets: list[list[int]], expect_sources: list[list[int]]
) -> None:
    assert [targets(src, dst, s) for s in range(src)] == expect_targets
    assert [sources(src, dst, r) for r in range(dst)] == expect_sources
    topo = KVTPTopology(src, dst, 0)
    assert topo.ratio == max(src, dst) // min(src, dst)
    assert topo.is_heterogeneous == (src != dst)


def test_non_divisible_rejected() -> None:
    topo = KVTPTopology(3, 2, 0)
    with pytest.raises(ConfigError, match="3->2"):
        validate_kv_tp_topology(topo)
    with pytest.raises(ConfigError):
        get_kv_target_ranks(topo)
    with pytest.raises(ConfigError):
        get_kv_source_ranks(topo)
    validate_kv_tp_topology(KVTPTopology(4, 2, 1))  # no raise


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 1, 0), "source_tp_size"),
        ((1, 0, 0), "target_tp_size"),
        ((2, 2, 2), "local_rank"),
        ((2, 4, -1), "local_rank"),
    ],
)
def test_topology_validation(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        KVTPTopology(*args)


def test_local_rank_checked_per_side() -> None:
    topo = KVTPTopology(1, 2, 1)  # valid as receiver rank 1, invalid as sender rank 1
    assert get_kv_source_ranks(topo) == [0]
    with pytest.raises(ConfigError, match="source"):
        get_kv_target_ranks(topo)
    with pytest.raises(ConfigError, match="target"):
        get_kv_source_ranks(KVTPTopology(2, 1, 1))


def test_topology_frozen() -> None:
    topo = KVTPTopology(2, 2, 0)
    with pytest.raises(AttributeError):
        topo.local_rank = 1  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(small=st.integers(1, 4), factor=st.integers(1, 4), src_bigger=st.booleans())
def test_targets_and_sources_consistent(small: int, factor: int, src_bigger: bool) -> None:
    big = small * factor
    src, dst = (big, small) if src_bigger else (small, big)
    for s in range(src):
        for r in range(dst):
            assert (r in targets(src, dst, s)) == (s in sources(src, dst, r))
    # every receiver gets data from someone, every sender sends somewhere
    assert all(sources(src, dst, r) for r in range(dst))
    assert all(targets(src, dst, s) for s in range(src))


# --------------------------------------------------------------------------- keys


def test_key_plain_format() -> None:
    assert get_kv_connector_key("req-1", 3, 0, 1, 2) == "req-1_3_0_1_2"
    assert get_kv_connector_key("abc", "thinker", 7, 0, 0) == "abc_thinker_7_0_0"


def test_key_escapes_separators() -> None:
    a = get_kv_connector_key("a_b", "c", 0, 0, 0)
    b = get_kv_connector_key("a", "b_c", 0, 0, 0)
    assert a != b
    assert a == "a%5Fb_c_0_0_0"
    assert get_kv_connector_key("50%", "1", 0, 0, 0) == "50%25_1_0_0_0"
    assert get_kv_connector_key("%5F", "1", 0, 0, 0) != get_kv_connector_key("_", "1", 0, 0, 0)


_ID = st.text(alphabet=st.sampled_from(list("ab_%5F2")), max_size=6)
_N = st.integers(0, 12)


@settings(max_examples=300, deadline=None)
@given(t1=st.tuples(_ID, _ID, _N, _N, _N), t2=st.tuples(_ID, _ID, _N, _N, _N))
def test_keys_never_collide(
    t1: tuple[str, str, int, int, int], t2: tuple[str, str, int, int, int]
) -> None:
    k1, k2 = get_kv_connector_key(*t1), get_kv_connector_key(*t2)
    assert (k1 == k2) == (t1 == t2)
    # escaped parts are free of "_", so the key always has exactly 5 fields
    assert len(k1.split("_")) == 5


def test_send_and_recv_keys_match() -> None:
    for src, dst in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)]:
        sent = {
            k
            for s in range(src)
            for k in build_rank_aware_send_keys("r_1", "0", "1", KVTPTopology(src, dst, s))
        }
        recv = [
            build_rank_aware_recv_keys("r_1", "0", "1", KVTPTopology(src, dst, r))
            for r in range(dst)
        ]
        flat = [key for per_rank in recv for key, _ in per_rank]
        assert set(flat) == sent
        assert len(flat) == len(sent)  # each key received exactly once


def test_recv_keys_rank_info() -> None:
    assert build_rank_aware_recv_keys("r", "0", "1", KVTPTopology(1, 1, 0)) == [("r_0_0_0_0", None)]
    assert build_rank_aware_recv_keys("r", "0", "1", KVTPTopology(4, 2, 1)) == [
        ("r_0_0_2_1", 2),
        ("r_0_0_3_1", 3),
    ]
    assert build_rank_aware_recv_keys("r", "0", "1", KVTPTopology(1, 2, 1)) == [("r_0_0_0_1", 0)]
    assert build_rank_aware_send_keys("r", "0", "1", KVTPTopology(1, 2, 0)) == [
        "r_0_0_0_0",
        "r_0_0_0_1",
    ]


def test_key_hooks() -> None:
    seen: list[tuple] = []

    def hook(*args: object) -> list:
        seen.append(args)
        return ["custom"]

    topo = KVTPTopology(2, 2, 1)
    assert build_rank_aware_send_keys("r", "0", "1", topo, hook=hook) == ["custom"]
    assert build_rank_aware_recv_keys("r", "0", "1", topo, hook=hook) == ["custom"]
    assert seen == [("r", "0", "1", topo), ("r", "0", "1", topo)]


# --------------------------------------------------------------------------- ports


def test_port_backward_compatible() -> None:
    assert kv_zmq_port(50000, 0, 0, 0) == 50000 + KV_ZMQ_PORT_OFFSET
    assert kv_zmq_port(50000, 3) == 50000 + KV_ZMQ_PORT_OFFSET + 3


def test_ports_distinct() -> None:
    seen: dict[int, tuple[int, int, int]] = {}
    for stage in range(16):
        for rank in range(8):
            for replica in range(4):
                port = kv_zmq_port(20000, stage, rank, replica)
                assert port not in seen, (stage, rank, replica, seen.get(port))
                seen[port] = (stage, rank, replica)
    assert len(seen) == 16 * 8 * 4


def test_port_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="65535"):
        kv_zmq_port(65500, 0, 0, 0)
    with pytest.raises(ValueError):
        kv_zmq_port(60000, 0, 0, 10)
    with pytest.raises(ConfigError):
        kv_zmq_port(1000, 99)
    with pytest.raises(ConfigError):
        kv_zmq_port(1000, 0, -1)
    with pytest.raises(ConfigError, match="from_stage"):
        kv_zmq_port(1000, "thinker")  # type: ignore[arg-type]
    assert kv_zmq_port(1000, "2") == kv_zmq_port(1000, 2)  # type: ignore[arg-type]
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "2")
    assert kv_zmq_port(1000, 1, 1) == kv_zmq_port(1000, 1, 1, 2)
    assert kv_zmq_port(1000, 1, 1) != kv_zmq_port(1000, 1, 1, 0)


# --------------------------------------------------------------------------- rank helpers


def test_rank_helpers_outside_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OMNI_REPLICA_ID", raising=False)
    assert get_local_tp_rank() == 0
    assert get_tp_world_size() == 1
    assert get_omni_replica_id() == 0
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "3")
    assert get_omni_replica_id() == 3
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "x")
    with pytest.raises(ConfigError, match="VLLM_OMNI_REPLICA_ID"):
        get_omni_replica_id()


def test_rank_helpers_use_vllm_tp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("vllm.distributed.parallel_state")
    fake._TP = object()  # type: ignore[attr-defined]
    fake.get_tensor_model_parallel_rank = lambda: 3  # type: ignore[attr-defined]
    fake.get_tensor_model_parallel_world_size = lambda: 4  # type: ignore[attr-defined]
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", fake)
    if "vllm" not in sys.modules:
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    assert get_local_tp_rank() == 3
    assert get_tp_world_size() == 4
    fake._TP = None  # type: ignore[attr-defined]
    assert get_local_tp_rank() == 0
    assert get_tp_world_size() == 1


def test_module_does_not_import_vllm() -> None:
    import subprocess

    code = (
        "import sys, vllm_omni_kv.kv_utils, vllm_omni_kv.kvcache.request_blocks; "
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_reexport() -> None:
    assert public.get_kv_connector_key is get_kv_connector_key
    for name in public.__all__:
        assert hasattr(public, name)


# --------------------------------------------------------------------------- merge / slice


def _payload(shards: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> dict:
    return {
        "request_id": "req",
        "layer_blocks": {"key_cache": shards, "value_cache": values},
        "block_ids": [3, 1],
        "metadata": {"seq_len": 5},
    }


def _rand(seq: int, heads: int, dim: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(seq, heads, dim).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 4])
def test_merge_then_slice_roundtrip(n: int, dtype: torch.dtype) -> None:
    shards = [
        _payload(
            [_rand(5, 2, dtype=dtype), None, _rand(5, 2, dtype=dtype)],
            [_rand(5, 2, dtype=dtype), None, _rand(5, 2, dtype=dtype)],
        )
        for _ in range(n)
    ]
    merged = merge_received_rank_shards(shards)
    assert merged is not None
    assert merged["request_id"] == "req" and merged["block_ids"] == [3, 1]
    assert merged["metadata"] == {"seq_len": 5}
    k0 = merged["layer_blocks"]["key_cache"][0]
    assert k0.shape == (5, 2 * n, 4)
    assert merged["layer_blocks"]["key_cache"][1] is None
    assert merged["layer_blocks"]["value_cache"][1] is None
    # head order follows source-rank order
    assert torch.equal(k0[:, 2:4], shards[1]["layer_blocks"]["key_cache"][0])
    for i, shard in enumerate(shards):
        part = slice_layer_blocks(merged["layer_blocks"], i, n)
        for name in ("key_cache", "value_cache"):
            for got, want in zip(part[name], shard["layer_blocks"][name], strict=True):
                if want is None:
                    assert got is None
                else:
                    assert got is not None and got.dtype == want.dtype
                    assert torch.equal(got, want)


def test_merge_edge_cases() -> None:
    assert merge_received_rank_shards([]) is None
    assert merge_received_rank_shards(None) is None  # type: ignore[arg-type]
    one = _payload([_rand(3, 2)], [_rand(3, 2)])
    assert merge_received_rank_shards([one]) is one
    assert merge_received_rank_shards([one, one], merger=lambda p: {"n": len(p)}) == {"n": 2}
    with pytest.raises(KVPayloadError, match="seq length"):
        merge_received_rank_shards([one, _payload([_rand(4, 2)], [_rand(4, 2)])])
    with pytest.raises(KVPayloadError, match="layers"):
        merge_received_rank_shards([one, _payload([_rand(3, 2)] * 2, [_rand(3, 2)] * 2)])
    with pytest.raises(KVPayloadError, match="None"):
        merge_received_rank_shards([one, _payload([None], [_rand(3, 2)])])
    with pytest.raises(KVPayloadError):
        merge_received_rank_shards([one, None])  # type: ignore[list-item]


def test_slice_received_rank_shard() -> None:
    full = _payload([torch.arange(24.0).view(2, 4, 3)], [None])
    # 1 -> 2: receiver rank 1 keeps heads 2..3
    out = slice_received_rank_shard(full, KVTPTopology(1, 2, 1))
    assert out is not None
    assert torch.equal(out["layer_blocks"]["key_cache"][0], torch.arange(24.0).view(2, 4, 3)[:, 2:])
    assert out["layer_blocks"]["value_cache"] == [None]
    assert out["request_id"] == "req"
    # 2 -> 4: receiver rank 2 gets sender 1's shard and keeps its first half
    out = slice_received_rank_shard(full, KVTPTopology(2, 4, 2))
    assert out is not None
    assert torch.equal(out["layer_blocks"]["key_cache"][0], torch.arange(24.0).view(2, 4, 3)[:, :2])
    # no slicing when target <= source
    assert slice_received_rank_shard(full, KVTPTopology(2, 1, 0)) is full
    assert slice_received_rank_shard(None, KVTPTopology(1, 2, 0)) is None
    assert slice_received_rank_shard(full, KVTPTopology(1, 2, 0), slicer=lambda p, t: "x") == "x"


def test_slice_tensor_errors() -> None:
    assert slice_kv_tensor_heads(None, 0, 2) is None
    with pytest.raises(KVPayloadError, match="equal"):
        slice_kv_tensor_heads(_rand(2, 3), 0, 2)
    with pytest.raises(ConfigError):
        slice_kv_tensor_heads(_rand(2, 4), 2, 2)


# --------------------------------------------------------------------------- layouts

NB, BS, H, D = 5, 4, 3, 8


def _check_views(
    raw: torch.Tensor | tuple, k_ref: torch.Tensor, v_ref: torch.Tensor, **kw: str
) -> None:
    out = normalize_layer_kv(raw, **kw)
    assert out is not None
    k, v = out
    assert k.shape == v.shape == (NB, BS, H, D)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    k[1, 2, 0, 3] = 1234.0  # writing through the view mutates the cache
    v[4, 0, 2, 7] = -99.0
    assert k_ref[1, 2, 0, 3] == 1234.0 and v_ref[4, 0, 2, 7] == -99.0


def test_normalize_flash() -> None:
    raw = torch.randn(2, NB, BS, H, D)
    _check_views(raw, raw[0], raw[1])
    assert detect_kv_layout(raw) == "flash"


def test_normalize_flashinfer() -> None:
    raw = torch.randn(NB, 2, BS, H, D)
    _check_views(raw, raw[:, 0], raw[:, 1])
    assert detect_kv_layout(raw) == "flashinfer"


def test_normalize_tuple() -> None:
    k, v = torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, D)
    out = normalize_layer_kv((k, v))
    assert out is not None and out[0] is k and out[1] is v
    assert detect_kv_layout((k, v)) == "tuple"


def test_normalize_cpu_layout() -> None:
    raw = torch.randn(NB, H, BS, 2 * D)
    assert detect_kv_layout(raw) == "cpu"
    # independent reference: the kernel's view, K half as [d, bs], V half as [bs, d]
    halves = raw.view(NB, H, 2, BS * D)
    k_kernel = halves[:, :, 0].reshape(NB, H, D, BS)
    v_kernel = halves[:, :, 1].reshape(NB, H, BS, D)
    _check_views(raw, k_kernel.permute(0, 3, 1, 2), v_kernel.permute(0, 2, 1, 3))
    # and explicit memory positions: per (block, head) K column-major, then V rows
    flat = raw.reshape(NB, H, -1)
    k, v = normalize_layer_kv(raw)  # type: ignore[misc]
    for b, t, h in [(0, 0, 0), (3, 2, 1), (4, 3, 2)]:
        assert torch.equal(k[b, t, h], flat[b, h, t : D * BS : BS])
        assert torch.equal(v[b, t, h], flat[b, h, (BS + t) * D : (BS + t + 1) * D])


def test_normalize_ambiguous_5d() -> None:
    raw = torch.randn(2, 2, BS, H, D)
    assert detect_kv_layout(raw) == "flash"
    k, v = normalize_layer_kv(raw)  # type: ignore[misc]
    assert torch.equal(k, raw[0])
    k, v = normalize_layer_kv(raw, layout="flashinfer")  # type: ignore[misc]
    assert torch.equal(k, raw[:, 0]) and torch.equal(v, raw[:, 1])


@pytest.mark.parametrize(
    "bad",
    [
        torch.randn(3, NB, BS, H, D),  # no K/V dim
        torch.randn(NB, BS, H),  # 3-D
        torch.randn(NB, H, BS, 2 * D + 1),  # odd last dim for cpu layout
        torch.randn(NB, H, BS, 2 * D).transpose(1, 2),  # cpu layout that cannot be viewed
        (torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, D + 1)),  # mismatched tuple
        (torch.randn(NB, BS, H, D),),  # one-element tuple
        "not a tensor",
    ],
)
def test_normalize_invalid(bad: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert normalize_layer_kv(bad, req_id="rq", layer_idx=7) is None  # type: ignore[arg-type]
    assert "rq" in caplog.text and "7" in caplog.text


def test_normalize_layout_hint_errors() -> None:
    with pytest.raises(ConfigError):
        normalize_layer_kv(torch.randn(2, NB, BS, H, D), layout="paged")
    assert normalize_layer_kv(torch.randn(2, NB, BS, H, D), layout="cpu") is None
    assert normalize_layer_kv(torch.randn(NB, H, BS, 2 * D), layout="flash") is None
    assert normalize_layer_kv(torch.randn(NB, H, BS, 2 * D), layout="tuple") is None
    assert set(KV_LAYOUTS) == {"flash", "flashinfer", "cpu", "tuple"}
