"""One conformance suite, run against every omni-connector backend.

A new backend proves itself by adding a harness in ``conformance.py`` and a
parameter here.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
import torch
from _threads import errors_in_threads

from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.wire.payload import KVCacheTransferData

from .conformance import Harness, checksum, make_harness, pull_backend


def _shm_param() -> object:
    reason = ""
    try:
        import vllm_omni_kv.backends.shm.connector  # noqa: F401
    except Exception as e:  # the shared-memory backend is written concurrently
        reason = f"vllm_omni_kv.backends.shm.connector does not import yet: {e}"
    return pytest.param("shm", marks=pytest.mark.skipif(bool(reason), reason=reason or "n/a"))


_HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None
_MC = [
    pytest.mark.mooncake,
    pytest.mark.skipif(not _HAS_MOONCAKE, reason="mooncake-transfer-engine is not installed"),
]

_HAS_NIXL = importlib.util.find_spec("nixl") is not None
_NIXL = [
    pytest.mark.nixl,
    pytest.mark.skipif(not _HAS_NIXL, reason="nixl is not installed (pip install nixl)"),
]

BACKENDS = [
    _shm_param(),
    "shm_share",  # share_cache: the same put/get contract with the cache region on
    pytest.param(
        "cuda_ipc",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
    pytest.param("mooncake_te", marks=[*_MC, pytest.mark.slow]),
    pytest.param("mooncake_te_cache", marks=[*_MC, pytest.mark.slow]),
    pytest.param("nixl", marks=[*_NIXL, pytest.mark.slow]),
    pytest.param("nixl_cache", marks=[*_NIXL, pytest.mark.slow]),
    pytest.param("mooncake_store", marks=[*_MC, pytest.mark.slow]),
]


@pytest.fixture(scope="module")
def harness_cache() -> Iterator[tuple[ExitStack, dict[str, Harness]]]:
    """Process/server-backed harnesses are started once per module and always stopped."""
    with ExitStack() as stack:
        yield stack, {}


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, harness_cache: tuple[ExitStack, dict[str, Harness]]
) -> Iterator[Harness]:
    name = request.param
    if name in ("shm", "shm_share", "cuda_ipc"):  # cheap; the /dev/shm leak check is per test
        with make_harness(name) as h:
            yield h
        return
    stack, cache = harness_cache
    if name not in cache:
        cache[name] = stack.enter_context(make_harness(name))
    yield cache[name]


def _key(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def test_tensor_roundtrip(backend: Harness) -> None:
    for t in (
        torch.randn(3, 5, 7),
        torch.arange(100, dtype=torch.int64),
        torch.randn(4, 4).bfloat16(),
    ):
        k = _key("tensor")
        ok, size, meta = backend.put(k, t)
        assert ok and size >= t.numel() * t.element_size()
        got = backend.get(k, meta)
        assert isinstance(got, torch.Tensor)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


def test_bytes_roundtrip(backend: Harness) -> None:
    for data in (b"tiny", bytes(range(256)) * 40):
        k = _key("bytes")
        ok, _size, meta = backend.put(k, data)
        assert ok
        assert backend.get(k, meta) == data


def test_dict_roundtrip(backend: Harness) -> None:
    obj = {
        "s": "hello",
        "n": 42,
        "f": 1.5,
        "none": None,
        "nested": {"list": [1, 2, 3], "blob": b"z" * 3000},
        "t": torch.randn(16, 8),
    }
    k = _key("dict")
    ok, _size, meta = backend.put(k, obj)
    assert ok
    got = backend.get(k, meta)
    assert got["s"] == "hello" and got["n"] == 42 and got["f"] == 1.5 and got["none"] is None
    assert got["nested"]["list"] == [1, 2, 3] and got["nested"]["blob"] == b"z" * 3000
    assert torch.equal(got["t"], obj["t"])


def test_kv_payload_roundtrip(backend: Harness) -> None:
    layers = 3
    kv = KVCacheTransferData(
        request_id="req-kv",
        layer_blocks={
            "key_cache": [torch.randn(10, 2, 64) for _ in range(layers)],
            "value_cache": [torch.randn(10, 2, 64) if i != 1 else None for i in range(layers)],
        },
        block_ids=[3, 4, 9],
        metadata={"seq_len": 10, "model": "tiny"},
    )
    k = _key("kv")
    ok, size, meta = backend.put(k, kv)
    assert ok and size == kv.packed_size()
    got = KVCacheTransferData.from_dict(backend.get(k, meta))
    assert got.request_id == "req-kv" and got.block_ids == [3, 4, 9]
    assert got.metadata == {"seq_len": 10, "model": "tiny"}
    assert got.layer_blocks["value_cache"][1] is None
    for name in ("key_cache", "value_cache"):
        for a, b in zip(got.layer_blocks[name], kv.layer_blocks[name], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.slow
def test_100mib_with_checksum(backend: Harness) -> None:
    k = _key("big")
    meta, expected = backend.put_random(k, 100 << 20, seed=7)
    got = backend.get(k, meta)
    assert got is not None
    data = (
        got
        if isinstance(got, torch.Tensor)
        else torch.frombuffer(bytearray(got), dtype=torch.uint8)
    )
    assert data.numel() * data.element_size() == 100 << 20
    assert checksum(data) == expected


def test_many_concurrent_keys(backend: Harness) -> None:
    n = 48
    items = {_key(f"c{i}"): torch.full((256 + i,), float(i)) for i in range(n)}
    metas = {k: backend.put(k, v)[2] for k, v in items.items()}

    def fetch(k: str) -> bool:
        got = backend.get(k, metas[k])
        return got is not None and torch.equal(got, items[k])

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(fetch, items))
    assert all(results), f"{results.count(False)} of {n} keys did not round-trip"


def test_missing_key_returns_none_within_timeout(backend: Harness) -> None:
    t0 = time.monotonic()
    assert backend.get(_key("never-put"), None) is None
    assert time.monotonic() - t0 < 5.0


def test_cleanup_withdraws_unconsumed(backend: Harness) -> None:
    k = _key("clean")
    ok, _size, meta = backend.put(k, torch.ones(1000))
    assert ok
    backend.cleanup(k)
    assert backend.get(k, meta) is None
    backend.cleanup(k)  # cleaning up twice (or an unknown key) is harmless
    backend.cleanup(_key("unknown"))


def test_get_consumes_once(backend: Harness) -> None:
    k = _key("once")
    _ok, _size, meta = backend.put(k, b"x" * 2048)
    assert backend.get(k, meta) == b"x" * 2048
    assert backend.get(k, meta) is None


def test_health(backend: Harness) -> None:
    k = _key("health")
    _ok, _size, meta = backend.put(k, b"h" * 100)
    before = backend.consumer.health().get("gets", 0)
    assert backend.get(k, meta) == b"h" * 100
    assert backend.producer_health()["status"] == "healthy"
    h = backend.consumer.health()
    assert h["status"] == "healthy"
    assert h["gets"] == before + 1


def test_close_idempotent(backend: Harness) -> None:
    c = backend.fresh()
    assert not c.closed
    c.close()
    c.close()
    assert c.closed
    assert c.health()["status"] == "closed"
    with pytest.raises(KVTransferError):
        c.put("0", "1", "after-close", b"x")


def test_context_manager_closes(backend: Harness) -> None:
    with backend.fresh() as c:
        assert not c.closed
    assert c.closed


def test_threads_do_not_deadlock(backend: Harness) -> None:
    """Puts and gets racing on different keys from several threads finish."""

    def worker(i: int) -> None:
        for j in range(5):
            k = _key(f"t{i}-{j}")
            _ok, _s, meta = backend.put(k, torch.full((64,), float(i * 10 + j)))
            got = backend.get(k, meta)
            assert got is not None and float(got[0]) == i * 10 + j

    errors = errors_in_threads(worker, 3, timeout=60)
    assert not errors, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(  # marked: `make gpu-check` runs the nixl one in its NIXL step
    "engine",
    [
        pytest.param("mooncake_te", marks=pytest.mark.mooncake),
        pytest.param("nixl", marks=pytest.mark.nixl),
    ],
)
def test_register_cache_cuda_pages_move_device_to_device(engine: str) -> None:
    """``register_cache`` with CUDA KV caches on both sides: each is registered with its
    connector's engine as device memory (NIXL: VRAM; Mooncake: its CUDA build) and the
    pages are read device to device. Written for ``make gpu-check``: it has **not run on
    a GPU yet**, and skips where the engine is not installed."""
    package = "mooncake" if engine == "mooncake_te" else "nixl"
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    if engine == "mooncake_te":
        from vllm_omni_kv.backends.pull.mooncake import cuda_build

        if not cuda_build():
            pytest.skip("the Mooncake CUDA build (mooncake-transfer-engine) is not installed")
    from vllm_omni_kv.backends.pull.selftest import CACHE_SELFTEST, pull_pages

    cls = pull_backend(engine)[0]
    extra = {"protocol": "tcp"} if engine == "mooncake_te" else {}
    with (
        cls({**CACHE_SELFTEST, "role": "sender", **extra}) as producer,
        cls({**CACHE_SELFTEST, "role": "receiver", **extra}) as consumer,
    ):
        assert pull_pages(producer, consumer, "cuda") == ("ok", True)
        region = producer.cache_region
        assert region.tensor.device.type == "cuda"  # registered as device memory
        assert region.digests is False  # verify_pages is for host caches
