"""``RecordingStreams``: a :class:`~vllm_omni_kv.kvcache.device_order.Streams` that runs
nothing asynchronously and records the order the code asked for, for tests without a GPU.

Install it for the host (``device_order.installed("cpu", RecordingStreams())``): the
stream paths then run on host tensors, every copy at once, while each stream keeps the
list of what was queued on it: work (every torch call made inside a ``use`` block of
it, by name, or :meth:`RecordingStreams.work` that a test adds to stand for a kernel,
e.g. the forward's write into a block), events recorded and events waited for. :meth:`RecordingStreams.before` answers whether
a GPU would run one position before another, following the waits across streams (what
CUDA guarantees, and nothing more); :attr:`RecordingStreams.host_waits` lists what the
host waited for, in order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: a place in a stream's queue: ``(stream name, index)``
Position = tuple[str, int]


@dataclass
class FakeStream:
    """One stream's queue of ``(kind, detail)`` entries; a wait names the position it
    waits for."""

    name: str
    ops: list[tuple[str, Any]] = field(default_factory=list)
    owner: RecordingStreams | None = None

    def add(self, kind: str, detail: Any = None) -> Position:
        assert self.owner is not None
        with self.owner.lock:
            self.ops.append((kind, detail))
            return self.name, len(self.ops) - 1

    def wait_event(self, event: Any) -> None:
        if event.at is not None:  # waiting for an event never recorded waits for nothing
            self.add("wait", event.at)

    def wait_stream(self, stream: Any) -> None:
        self.add("wait", stream.tail())

    def synchronize(self) -> None:
        assert self.owner is not None
        self.owner.host_wait(self.tail())

    def query(self) -> bool:
        return True

    def tail(self) -> Position:
        """The position of the last entry (everything queued so far)."""
        return self.add("mark")


class _Queueing(TorchFunctionMode):
    """Inside a ``use`` block: every torch call is work queued on its stream."""

    def __init__(self, stream: FakeStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.stream.add("work", getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@dataclass
class FakeEvent:
    """An event: the position it was last recorded at; ``done`` is what ``query`` says."""

    owner: RecordingStreams
    at: Position | None = None
    done: bool = True

    def record(self, stream: Any = None) -> None:
        stream = stream if stream is not None else self.owner.current(torch.device("cpu"))
        self.at = stream.add("record")

    def synchronize(self) -> None:
        if self.at is not None:
            self.owner.host_wait(self.at)

    def query(self) -> bool:
        return self.done


class RecordingStreams:
    """Streams that record instead of run. The default stream of every thread is
    :attr:`forward` (as vLLM's model runner and its load threads share the device's
    default stream); ``side`` gives each thread a stream of its own."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.streams: dict[str, FakeStream] = {}
        self.forward = self._stream("forward")
        self.host_waits: list[Position] = []
        self.events: list[FakeEvent] = []
        self.devices: list[tuple[str, torch.device]] = []  # (thread name, device)
        #: events made while set report work still running (``query`` False), as on a GPU
        #: busy with a forward
        self.busy = False
        self._local = threading.local()

    def _stream(self, name: str) -> FakeStream:
        with self.lock:
            name = name if name not in self.streams else f"{name}#{len(self.streams)}"
            s = self.streams[name] = FakeStream(name, owner=self)
            return s

    # -- the Streams interface ---------------------------------------------------------
    def current(self, device: torch.device) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.forward

    def side(self, device: torch.device) -> FakeStream:
        s = getattr(self._local, "side", None)
        if s is None:
            s = self._local.side = self._stream(f"side-{threading.current_thread().name}")
        return s

    def new_stream(self, device: torch.device) -> FakeStream:
        return self._stream("stream")

    def event(self) -> FakeEvent:
        e = FakeEvent(self, done=not self.busy)
        with self.lock:
            self.events.append(e)
        return e

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(stream)
        try:
            with _Queueing(stream):
                yield
        finally:
            stack.pop()

    def set_device(self, device: torch.device) -> None:
        with self.lock:
            self.devices.append((threading.current_thread().name, device))

    # -- what tests read -------------------------------------------------------------------
    def work(self, stream: FakeStream, label: str) -> Position:
        """Queue a kernel named ``label`` on ``stream`` (what the code under test does not
        run itself, e.g. the forward's writes)."""
        return stream.add("work", label)

    def host_wait(self, at: Position) -> None:
        with self.lock:
            self.host_waits.append(at)

    def queued(self, stream: FakeStream | str, op: str) -> list[Position]:
        """The positions of the torch calls named ``op`` (``copy_``, ``index_select``)
        made while ``stream`` was current inside ``use``: the kernels it queued."""
        s = self.streams[stream] if isinstance(stream, str) else stream
        return [(s.name, i) for i, (k, d) in enumerate(s.ops) if k == "work" and d == op]

    def side_streams(self) -> list[FakeStream]:
        return [s for n, s in self.streams.items() if n.startswith("side-")]

    def before(self, a: Position, b: Position) -> bool:
        """Whether a GPU runs position ``a`` before position ``b``: ``b`` follows ``a`` in
        one stream, or through waits for events recorded after ``a``."""
        if b[0] == a[0]:
            return b[1] > a[1]
        seen: set[Position] = set()
        todo = self._preceding(b)
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            if p[0] == a[0] and p[1] >= a[1]:
                return True
            todo += self._preceding(p)
        return False

    def _preceding(self, at: Position) -> list[Position]:
        """What runs right before ``at``: the entry before it and, for a wait, what it
        waits for."""
        name, i = at
        out = [(name, i - 1)] if i > 0 else []
        kind, detail = self.streams[name].ops[i]
        if kind == "wait":
            out.append(detail)
        return out

    def waited_for(self, at: Position) -> bool:
        """Whether the host waited for ``at`` (directly, or for a later position of its
        stream or one ordered after it)."""
        return any(w == at or self.before(at, w) for w in self.host_waits)
