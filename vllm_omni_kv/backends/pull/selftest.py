"""The round trips ``doctor --selftest`` runs through a pull backend: a tensor and an
object through the pool, and (``register_cache``) pages of one connector's registered
KV cache pulled by another."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.pull.pull import PullTransferConnector
from vllm_omni_kv.kvcache.cache_layout import infer_identity
from vllm_omni_kv.kvcache.shared_pages import describe_request, layer_geometry, shared_fields


def pull_round_trip(sender: PullTransferConnector, receiver: PullTransferConnector) -> str | None:
    """Put a tensor and an object on ``sender`` and pull both through ``receiver`` (they
    may be one dual-role connector); None when both came back equal, else what went wrong."""
    t = torch.arange(1024, dtype=torch.float32)
    ok, _size, meta = sender.put("0", "1", "selftest-t", t)
    got = receiver.get("0", "1", "selftest-t", meta)
    if not ok or got is None:
        return "tensor round trip returned nothing"
    buf = got[0]
    assert isinstance(buf, ManagedBuffer)
    with buf:
        same = torch.equal(buf.to_tensor(), t)
    ok2, _, _ = sender.put("0", "1", "selftest-o", {"x": t, "s": "hi"})
    where = {"source_host": "127.0.0.1", "source_port": sender.zmq_port}
    got2: tuple[Any, int] | None = receiver.get("0", "1", "selftest-o", where)
    same2 = ok2 and got2 is not None and torch.equal(got2[0]["x"], t) and got2[0]["s"] == "hi"
    return None if same and same2 else "round trip returned different data"


#: the connectors of :func:`cache_round_trip` (plus ``role`` and the backend's own keys)
CACHE_SELFTEST = {
    "host": "127.0.0.1",
    "zmq_port": 0,
    "memory_pool_size": 4 << 20,
    "transfer_timeout_s": 10.0,
    "register_cache": True,
    "verify_pages": True,
}


def cache_round_trip(
    cls: Callable[[dict[str, Any]], PullTransferConnector], **extra: Any
) -> dict[str, Any]:
    """``doctor --selftest`` of ``register_cache``: a producer connector (``cls``, role
    sender) allocates a small KV cache in its region the way vLLM does (inside the
    allocation context) and publishes a shared-pages payload of a few blocks; a consumer
    connector (role receiver) pulls just those pages straight out of it into its own
    registered cache under the payload's lease. Both caches are compared, and the
    producer's hold must be gone once the copy ended."""
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            producer = stack.enter_context(cls({**CACHE_SELFTEST, "role": "sender", **extra}))
            consumer = stack.enter_context(cls({**CACHE_SELFTEST, "role": "receiver", **extra}))
            verdict, released = pull_pages(producer, consumer, "cpu")
            transport = consumer.transport()
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}
    ms = (time.perf_counter() - t0) * 1e3
    return {
        "ok": verdict == "ok" and released,
        "detail": f"{len(IDS)} pages x {LAYERS} layers pulled from another connector's "
        f"registered cache ({verdict}; hold released={released}) in {ms:.0f} ms",
        "transport": transport,
    }


LAYERS, BLOCKS, HEADS, BS, DIM = 2, 64, 2, 16, 64  # 1 MiB of fp16 K|V
IDS = [3, 4, 5, 9, 1]


def cache_of(conn: PullTransferConnector, device: str = "cpu") -> list[torch.Tensor]:
    """A small vLLM-like KV cache (one ``int8`` allocation, viewed per layer) allocated in
    ``conn``'s region context on ``device``."""
    region = conn.cache_region
    assert region is not None, "register_cache is off"
    per = BLOCKS * HEADS * BS * 2 * DIM * 2
    with region.allocation_context() or contextlib.nullcontext():
        buf = torch.zeros(LAYERS * per, dtype=torch.int8, device=device)
    shape = (BLOCKS, HEADS, BS, 2 * DIM)
    return [buf[i * per : (i + 1) * per].view(torch.float16).view(shape) for i in range(LAYERS)]


def pull_pages(
    producer: PullTransferConnector, consumer: PullTransferConnector, device: str
) -> tuple[str, bool]:
    """Allocate a seeded cache on ``producer`` and an empty one on ``consumer`` (both on
    ``device``), publish pages :data:`IDS` and copy them into the same blocks through
    ``consumer``: ``(verdict, whether the producer's hold is gone)``."""
    region, local = producer.cache_region, consumer.cache_region
    assert region is not None and local is not None
    theirs, mine = cache_of(producer, device), cache_of(consumer, device)
    g = torch.Generator().manual_seed(1234)
    for v in theirs:
        v.copy_(torch.randn(v.shape, generator=g).half())
    got = region.export(theirs)
    if got is None or local.export(mine) is None:
        return "a cache was not registered (see the log)", False
    desc, base, nbytes = got
    ident = infer_identity(theirs[0], packing="k_v")
    hold = region.hold("selftest", "consumer", "k")
    region.ready(theirs)
    shared = {"region": desc, "geometry": layer_geometry(theirs, base, nbytes), "hold": hold}
    data = describe_request("k", IDS, len(IDS) * BS, theirs, ident, shared, digests=region.digests)
    producer.put("selftest", "consumer", "k", data)
    consumer.update_sender_info(producer.host, producer.zmq_port)
    stream = consumer.open_stream("selftest", "consumer", "k")
    if stream is None:
        return "payload not found", False
    with stream:
        _meta, fields, src = shared_fields(stream.obj)
        with local.reading(fields["hold"]):
            local.copy_into(
                fields["region"],
                fields["geometry"],
                ident,
                mine,
                list(zip(src, src, strict=True)),
                fields["sums"],
                0,
            )
            if device.startswith("cuda"):
                torch.cuda.current_stream().synchronize()
    same = all(torch.equal(m[b], t[b]) for m, t in zip(mine, theirs, strict=True) for b in IDS)
    return ("ok" if same else "pages differ"), region.released(hold)
