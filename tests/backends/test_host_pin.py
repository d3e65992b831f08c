"""Registering host memory with CUDA (``backends/host_pin.py``): a refused registration
leaves no CUDA error pending, so the next kernel launch in the thread does not raise it;
registering a range ours already covers is "already pinned", not an error."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import pytest
import torch

from vllm_omni_kv.backends.host_pin import CudaPinOps, clear_cuda_error, cuda_in_use, register

MIB = 2**20


@pytest.fixture
def host_range() -> Iterator[tuple[int, int]]:
    """``(address, bytes)`` of 4 MiB of shared anonymous memory (as a shared-memory segment)."""
    mm = mmap.mmap(-1, 4 * MIB)
    anchor = ctypes.c_char.from_buffer(mm)
    yield ctypes.addressof(anchor), len(mm)
    del anchor
    mm.close()


def _pinned(ptr: int, nbytes: int) -> bool:
    return torch.frombuffer(
        (ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8
    ).is_pinned()


def _kernel_runs() -> None:
    x = torch.arange(1 << 16, device="cuda", dtype=torch.int64) * 2  # a kernel launch
    torch.cuda.synchronize()
    assert int(x.sum()) == (1 << 16) * ((1 << 16) - 1)


def test_nothing_is_registered_without_cuda_in_use(host_range: tuple[int, int]) -> None:
    if cuda_in_use():
        pytest.skip("CUDA is initialized in this process")
    assert register(*host_range) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_refused_registration_leaves_no_pending_error(host_range: tuple[int, int]) -> None:
    torch.cuda.init()
    ptr, nbytes = host_range
    # the precondition: torch's wrapper leaves a refused registration's error pending
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(ptr, nbytes, 1)) == 0
    try:
        assert int(cudart.cudaHostRegister(ptr, nbytes, 1)) == 712  # already registered
        assert clear_cuda_error() == 712, "the refused registration left no error to clear"
        assert clear_cuda_error() == 0
        assert register(ptr, nbytes) is None  # someone else's registration: refused (712)
        _kernel_runs()
    finally:
        assert int(cudart.cudaHostUnregister(ptr)) == 0
    pin = register(ptr, nbytes)
    assert pin is not None and pin.owned
    try:
        again = register(ptr, nbytes)  # ours already: pinned, nothing asked of the driver
        assert again is not None and not again.owned
        assert _pinned(ptr, nbytes)
        again.release()  # releases nothing: the range stays registered by ``pin``
        assert _pinned(ptr, nbytes)
        _kernel_runs()
    finally:
        pin.release()
    pin.release()  # idempotent
    assert int(CudaPinOps().unregister(ptr, torch.cuda.current_device())) == 713  # not registered
    _kernel_runs()
