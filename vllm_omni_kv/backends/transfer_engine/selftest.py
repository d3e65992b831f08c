"""The loopback round trip ``doctor --selftest`` runs through a pull backend."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.backends.transfer_engine.pull import PullTransferConnector


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
