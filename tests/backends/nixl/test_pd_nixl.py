"""Prefill/decode through real vLLM engines over the nixl backend: token equality.

The producer engine stages each request's KV in its NIXL-registered pool; the consumer
engine leases it over the side channel and has the producer WRITE it into its own pool
(``nixl_direction: write``; the READ direction runs through engines in
``tests/connector/test_serve_one_copy.py[nixl_cache]``) before decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "connector"))

from pd_helpers import (  # noqa: E402
    PullPD,
    assert_killed_producer_recomputes,
    assert_pull_loads_equal,
    omni_ktc,
    pull_pd,
)

from vllm_omni_kv.testing.net import free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nixl]

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

RECV_TIMEOUT = 15.0
POOL = 64 << 20


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path) -> Iterator[PullPD]:
    common = {"host": "127.0.0.1", "memory_pool_size": POOL}
    prod_ktc = omni_ktc(
        "kv_producer",
        backend="nixl",
        backend_extra={**common, "role": "sender", "zmq_port": free_port()},
    )
    cons_ktc = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="nixl",
        recv_timeout=RECV_TIMEOUT,
        backend_extra={
            **common,
            "role": "receiver",
            "side_channel_timeout_s": 1.0,
            "nixl_direction": "write",
        },
    )
    with pull_pd(tiny_model_dir, "nixl", prod_ktc, cons_ktc, seed=31) as pd:
        yield pd


def test_nixl_transfer_gives_colocated_tokens(pd: PullPD) -> None:
    assert_pull_loads_equal(pd)


def test_nixl_killed_producer_recomputes(pd: PullPD) -> None:
    assert_killed_producer_recomputes(pd, RECV_TIMEOUT)
