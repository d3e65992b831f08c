"""Prefill/decode over the Mooncake Transfer Engine backend (TCP), when it imports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import (
    PullPD,
    assert_killed_producer_recomputes,
    assert_pull_loads_equal,
    omni_ktc,
    pull_pd,
)

from vllm_omni_kv.testing.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.mooncake]

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine wheel is not installed")
pytest.importorskip("vllm_omni_kv.backends.pull.mooncake")

# Mooncake's TCP transport occasionally stalls a read (kvcache-ai/Mooncake#4209); the backend
# turns a stall into a ~3 s retry (tcp_progress_timeout_s), so leave room for a few of them.
RECV_TIMEOUT = 15.0
POOL = 64 << 20


@pytest.fixture(scope="module")
def mc(tiny_model_dir: Path) -> Iterator[PullPD]:
    common = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": POOL}
    prod_ktc = omni_ktc(
        "kv_producer",
        backend="mooncake",
        transfer_format="token_major",  # the shm tests cover the raw-block format
        backend_extra={**common, "role": "sender", "zmq_port": free_port()},
    )
    cons_ktc = omni_ktc(
        "kv_consumer",
        "recompute",
        backend="mooncake",
        recv_timeout=RECV_TIMEOUT,
        backend_extra={**common, "role": "receiver", "side_channel_timeout_s": 1.0},
    )
    with pull_pd(tiny_model_dir, "mc", prod_ktc, cons_ktc, seed=21) as pd:
        yield pd


def test_mooncake_transfer_gives_colocated_tokens(mc: PullPD) -> None:
    assert_pull_loads_equal(mc)


def test_mooncake_killed_producer_recomputes(mc: PullPD) -> None:
    assert_killed_producer_recomputes(mc, RECV_TIMEOUT)
