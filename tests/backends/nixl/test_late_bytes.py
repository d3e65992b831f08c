"""A NIXL transfer given up on may still move bytes: releasing a running transfer does
not stop it over every UCX transport (over TCP its bytes keep landing after ``release``
returned). Real agents in this process (UCX over TCP on loopback, as between hosts
without RDMA), a 192 MiB move with a 5 ms timeout, READ by the consumer or written by the
producer (``nixl_direction``): a move that raises leaves no byte to land later unless it
says so (:class:`~vllm_omni_kv.backends.pull.puller.ReadStillRunning`, whose future
completes only once the last byte landed).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

from vllm_omni_kv.backends.nixl.connector import NixlPullConnector  # noqa: E402
from vllm_omni_kv.backends.pull.puller import ReadStillRunning  # noqa: E402
from vllm_omni_kv.errors import KVTransferError  # noqa: E402

from ..conformance import nixl_config  # noqa: E402

N = 192 << 20

pytestmark = pytest.mark.nixl


def _landed(dst: np.ndarray) -> int:
    return int(np.count_nonzero(dst))


@pytest.mark.parametrize("direction", ["read", "write"])
def test_a_move_that_gives_up_says_whether_bytes_may_still_land(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX as each agent starts
    s = NixlPullConnector(nixl_config("sender", pool_mib=N >> 20))
    r = NixlPullConnector(
        nixl_config(
            "receiver", pool_mib=N >> 20, transfer_timeout_s=0.005, nixl_direction=direction
        )
    )
    try:
        src = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(s.base_ptr))
        dst = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(r.base_ptr))
        src[:] = 7
        raised = 0
        for _ in range(3):
            dst[:] = 0
            try:
                r.engine.read_many(s.engine.session, [(r.base_ptr, s.base_ptr, N)])
                continue  # it ended within its timeout
            except ReadStillRunning as e:
                e.ended.result(timeout=60)
            except KVTransferError:
                pass  # it ended (failed) when it raised
            raised += 1
            at_end = _landed(dst)
            time.sleep(0.3)
            assert _landed(dst) == at_end, "bytes landed after the read said none could"
        assert raised, "every 192 MiB read ended within 5 ms: nothing was tested"
    finally:
        r.close()
        s.close()
