"""NIXL's memory kinds: of a torch device, of a registered range, of page tables; and
when a READ of a peer's device memory is likely to run at TCP speed."""

from __future__ import annotations

import functools
import socket

import torch

from vllm_omni_kv.backends.pull.page_reads import PageTable
from vllm_omni_kv.kvcache.device_order import bind_device
from vllm_omni_kv.kvcache.device_staging import canonical_device

#: a registered range: ``(address, bytes, memory type, device id)``
Span = tuple[int, int, str, int]
#: NIXL's memory type and device id of a range
Kind = tuple[str, int]


def memory_of(device: str) -> Kind:
    """NIXL's ``(memory type, device id)`` of a torch device string (``cpu``, ``cuda:N``;
    ``cuda`` is the current device, as for torch)."""
    d = canonical_device(device)
    return ("VRAM", d.index or 0) if d.type == "cuda" else ("DRAM", 0)


def registration_hint(mem: str) -> str:
    """What to check when NIXL refuses to register memory of type ``mem``."""
    if mem == "VRAM":
        return "(is NIXL's CUDA build installed, nixl-cu12 or nixl-cu13 as torch's CUDA?)"
    return "(memlock limits? try a smaller memory_pool_size)"


def use_device(kind: Kind) -> None:
    """Make ``kind``'s CUDA device the calling thread's (``VRAM``; nothing for ``DRAM``), as
    the pull threads do before their reads: the side-channel thread that posts a WRITE and
    the thread that polls it are not vLLM's, and start on device 0."""
    if kind[0] == "VRAM":
        bind_device(torch.device("cuda", kind[1]))


def kind_of(spans: list[Span], addr: int, n: int) -> Kind | None:
    """The memory type and device of the registered range holding ``[addr, addr+n)``."""
    for base, size, mem, dev in spans:
        if base <= addr and addr + n <= base + size:
            return mem, dev
    return None


def tables_kind(spans: list[Span], tables: tuple[PageTable, ...]) -> Kind | None:
    """The one memory type and device holding every table (None: not all registered, or
    in memory of several kinds)."""
    kinds = {kind_of(spans, *t.extent) for t in tables}
    return kinds.pop() if len(kinds) == 1 else None


def producer_writes(direction: str, remote_memory: str) -> bool:
    """Whether, under ``nixl_direction`` ``direction``, a move out of a peer's memory of
    type ``remote_memory`` (``"VRAM"``, ``"DRAM"``) is the peer's WRITE rather than this
    agent's READ (``auto``: writes out of device memory, where UCX serves a READ by TCP)."""
    return direction == "write" or (direction == "auto" and remote_memory == "VRAM")


def posting(direction: str, remote_memory: set[str]) -> str:
    """The suffix of a transport name that says who posts the moves out of peers' memory
    of types ``remote_memory``: ``/write`` (every move is the peer's WRITE), ``/read+write``
    (some are), ``""`` (this agent READs every one)."""
    writes = {producer_writes(direction, m) for m in remote_memory}
    if direction == "write" or writes == {True}:
        return "/write"
    return "/read+write" if writes == {True, False} else ""


def who_posts(direction: str, remote_memory: list[str]) -> str:
    """Per memory of a peer (``"VRAM:0"``...), who posts the moves out of it, for the log."""
    ways = [
        f"{m} by its WRITE" if producer_writes(direction, m.split(":")[0]) else f"{m} by our READ"
        for m in remote_memory
    ]
    return ", ".join(ways) or "none"


def device_read_warning(remote_memory: list[str], endpoint: str) -> str | None:
    """Why a READ of ``remote_memory`` (``"VRAM:0"``...) from ``endpoint`` may run at TCP
    speed, with what to do instead (None: no device memory, or another host)."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if not any(m.startswith("VRAM") for m in remote_memory) or not _this_host(host):
        return None
    return (
        "reads of the peer's GPU memory on this host go by NIXL READ, which UCX has served "
        "over TCP (0.45-0.56 GB/s on an H200, with UCX_TLS unset or cuda_ipc,cuda_copy,tcp); "
        "on one host use backend 'cuda_ipc' (or 'shm'), or host pools (memory_pool_device: cpu)"
    )


def _this_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, or one of its own addresses)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    return host in _own_addresses()


@functools.cache
def _own_addresses() -> frozenset[str]:
    """This machine's addresses by its host name (looked up once per process)."""
    try:
        return frozenset(str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        return frozenset()
