"""Ordering work between an accelerator's streams, behind one small interface.

The CUDA paths order their copies with streams and events: a side stream waits for
an event recorded on the forward stream before it reads or writes blocks, the forward
stream waits for the side stream before it reuses them, and a buffer is exposed to
another process only once an event recorded after its copy has completed. They take
those operations from :func:`streams_of` (a device's :class:`Streams`, None for the
host), never from ``torch.cuda`` directly, so that a test can install a recording
implementation for the host (:func:`installed`) and check the order without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """What the CUDA paths use of ``torch.cuda.Event``."""

    def record(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class DeviceStream(Protocol):
    """What the CUDA paths use of ``torch.cuda.Stream``."""

    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...
    def synchronize(self) -> None: ...


class Streams(Protocol):
    """The stream operations of one kind of device."""

    def current(self, device: torch.device) -> DeviceStream:
        """The calling thread's current stream on ``device`` (the forward's, on the
        engine thread)."""

    def side(self, device: torch.device) -> DeviceStream:
        """The calling thread's own side stream on ``device`` (created once per thread)."""

    def new_stream(self, device: torch.device) -> DeviceStream:
        """A new stream on ``device``."""

    def event(self) -> DeviceEvent:
        """A new event (not recorded yet)."""

    def use(self, stream: DeviceStream) -> AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the block."""

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the calling thread's device, with its context current."""


class CudaStreams:
    """:class:`Streams` of CUDA devices (``torch.cuda``)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self, device: torch.device) -> DeviceStream:
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device) -> DeviceStream:
        by_device = getattr(self._local, "streams", None)
        if by_device is None:
            by_device = self._local.streams = {}
        stream = by_device.get(device.index)
        if stream is None:
            stream = by_device[device.index] = torch.cuda.Stream(device)
        return stream

    def new_stream(self, device: torch.device) -> DeviceStream:
        return torch.cuda.Stream(device)

    def event(self) -> DeviceEvent:
        return torch.cuda.Event()

    def use(self, stream: DeviceStream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def set_device(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        if getattr(self._local, "device", None) == device and (
            torch.cuda.current_device() == device.index
        ):
            return
        torch.cuda.set_device(device)
        # torch skips cudaSetDevice when the index already is the current one, which in
        # a new thread leaves no context current: a call that needs one binds it
        torch.cuda.mem_get_info(device)
        self._local.device = device


#: the CUDA implementation every CUDA path uses
CUDA = CudaStreams()
_by_type: dict[str, Streams] = {"cuda": CUDA}
_lock = threading.Lock()


def streams_of(device: torch.device | str | None) -> Streams | None:
    """The stream operations of ``device``; None where work runs synchronously (the host,
    unless a test installed a recording implementation for it)."""
    if device is None:
        return None
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _by_type.get(kind)


@contextlib.contextmanager
def installed(device_type: str, streams: Streams) -> Iterator[Streams]:
    """Use ``streams`` for every device of ``device_type`` inside the block (tests run the
    stream paths on host tensors this way)."""
    with _lock:
        before = _by_type.get(device_type)
        _by_type[device_type] = streams
    try:
        yield streams
    finally:
        with _lock:
            if before is None:
                _by_type.pop(device_type, None)
            else:
                _by_type[device_type] = before


def mark(streams: Streams, device: torch.device) -> DeviceEvent:
    """An event recorded now on the calling thread's current stream of ``device``: later
    work made to wait on it runs after everything queued there so far."""
    event = streams.event()
    event.record(streams.current(device))
    return event


def settle(streams: Streams, device: torch.device) -> None:
    """Wait on the host until the work queued so far on the current stream of ``device``
    has run (an event recorded now, waited for)."""
    mark(streams, device).synchronize()


def cuda_device_in_use() -> torch.device | None:
    """The calling thread's CUDA device where this process already uses CUDA; None
    otherwise (asking would create a context in a process that never used the GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def bind_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's device where it has a stream implementation
    (a thread that touches a CUDA cache or pool; a no-op for the host)."""
    streams = streams_of(device)
    if device is not None and streams is not None:
        streams.set_device(device)
