"""A mapping of a cache segment stays mapped while any tensor over it lives.

``torch.frombuffer`` keeps no buffer export of the object it is given, so a region that
unmaps a segment (closing, or replacing a dead producer's mapping) while a copy still
holds page views over it made the next read of those views crash the process (the
one-copy consumer's SIGSEGV in its page copy). The checks run in a child process so a
regression fails the test instead of killing the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

from vllm_omni_kv.backends.shm import arena

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from vllm_omni_kv.backends.shm import arena
    from vllm_omni_kv.backends.shm.cache_region import ShmCacheRegion
    from vllm_omni_kv.backends.shm.producer import ProducerArena

    ns = sys.argv[1]
    producer_arena = ProducerArena(0, namespace=ns)
    producer = ShmCacheRegion(ns, producer_arena, arena.STALE_S)
    cache = producer.allocate(3 << 20)
    cache.copy_(torch.arange(3 << 20, dtype=torch.int64).to(torch.int8))
    desc, _base, _n = producer.export([cache.view(-1, 4096)])

    consumer = ShmCacheRegion(ns, ProducerArena(1, namespace=ns), arena.STALE_S)
    view = consumer.attach(desc)
    pages = view.view(-1, 4096)[5:9]  # what a copy in flight holds
    consumer.close()  # unmaps what it can: never the pages above
    expect = torch.arange(5 * 4096, 9 * 4096, dtype=torch.int64).to(torch.int8).view(torch.uint8)
    assert torch.equal(pages.reshape(-1), expect), "consumer view changed"

    producer.close()
    producer_arena.close()  # vLLM still holds its cache tensor: it must stay readable
    assert torch.equal(cache.view(torch.uint8)[5 * 4096 : 9 * 4096], expect), "cache changed"
    print("ok")
    """
)


def test_views_outlive_closed_regions() -> None:
    ns = f"ml-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, ns], capture_output=True, text=True, timeout=120
        )
    finally:
        for name in arena.namespace_files(ns):
            arena.unlink_quiet(name)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip().endswith("ok")
