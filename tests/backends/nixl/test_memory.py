"""NIXL memory kinds of torch devices, and the CUDA device a thread posting a transfer makes
current (recorded through the stream interface: no GPU here)."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_omni_kv.backends.nixl import memory
from vllm_omni_kv.kvcache.device_order import installed
from vllm_omni_kv.testing.fake_streams import RecordingStreams


def test_memory_kinds_of_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda`` without an index is the current device, as for torch (not device 0)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert memory.memory_of("cpu") == ("DRAM", 0)
    assert memory.memory_of("cuda:1") == ("VRAM", 1)
    assert memory.memory_of("cuda") == ("VRAM", 3)


def test_a_thread_posting_from_device_memory_makes_that_device_its_own() -> None:
    """The side-channel thread that posts a producer's WRITE (and the one that polls it)
    start on device 0: a transfer out of ``VRAM`` of device N makes N theirs first, through
    the stream interface (recorded here); host memory never touches it."""
    with installed("cuda", RecordingStreams()) as streams:

        def post() -> None:
            for kind in [("DRAM", 0), ("VRAM", 1), ("DRAM", 2)]:
                memory.use_device(kind)

        t = threading.Thread(target=post, name="w")
        t.start()
        t.join()
    assert streams.devices == [("w", torch.device("cuda", 1))]
