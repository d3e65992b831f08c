"""``FakeBackend``: an in-process omni connector for unit tests of the layers above.

Frames are packed into bytearrays held in a process-global table keyed by
``(namespace, from_stage, to_stage, key)``, so a producer and a consumer instance
in one process see each other. ``open_stream`` claims an entry (once); its
``load(spans)`` copies only the chunk-aligned byte ranges covering ``spans`` from
the producer's bytearray into a private buffer, verifies each chunk and counts
the copied bytes in ``moved`` (plus header and trailer), as a ranged transport
would. ``discard`` drops an entry without copying payload bytes.

Knobs (config keys; also attributes a test may change between calls):

* ``namespace`` (``"default"``): isolates tests from each other.
* ``delay_s`` (0): a put becomes visible this long after it returns.
* ``fail_puts`` (0): the next N puts fail, returning ``(False, 0, None)``.
* ``corrupt_next`` (None): the next put flips one byte in its chunk number
  ``corrupt_next`` (negative counts from the end) after that chunk's digest is written.
* ``streaming`` (False): a put publishes its entry once the header is written and
  packs the data from a background thread, sleeping ``step_s`` (0.002) per packed
  step; ``open_stream`` works before the data is there and ``load`` waits for it.

Leak checks: :func:`live_keys` (unconsumed entries), :func:`clear`, and
``health()["open_streams"]`` (streams opened and not closed). Register it with
the factory under a name with :func:`register_fake_backend`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.keys import key_of_request
from vllm_omni_kv.backends.stats import COMMON, Counters
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.digests import verify_head
from vllm_omni_kv.wire.stream import ChunkedStream, PayloadStream, check_cancel

EntryKey = tuple[str, str, str, str]


@dataclass
class _Entry:
    buf: bytearray
    size: int
    visible_at: float
    progress: int = 0  # leading bytes final (the whole frame once ``done``)
    done: bool = False
    failed: str | None = None


_COND = threading.Condition()
_ENTRIES: dict[EntryKey, _Entry] = {}


def live_keys(namespace: str | None = None) -> list[EntryKey]:
    """Unconsumed entries (all namespaces, or one)."""
    with _COND:
        return sorted(k for k in _ENTRIES if namespace is None or k[0] == namespace)


def clear(namespace: str | None = None) -> None:
    """Drop unconsumed entries (all namespaces, or one)."""
    with _COND:
        for k in [k for k in _ENTRIES if namespace is None or k[0] == namespace]:
            del _ENTRIES[k]


def register_fake_backend(name: str = "fake") -> None:
    """Make ``FakeBackend`` creatable through ``OmniConnectorFactory`` as ``name``."""
    OmniConnectorFactory.register_connector(name, FakeBackend)


class FakeStream(ChunkedStream):
    """A claimed fake entry, copied range by range into a private buffer."""

    def __init__(self, entry: _Entry, name: str, owner: FakeBackend) -> None:
        self._e, self._name, self._owner = entry, name, owner
        local = bytearray(entry.size)
        self._local = local
        self.frame_address = int(np.frombuffer(local, dtype=np.uint8).ctypes.data)
        mv = memoryview(local)
        p = codec.read_prelude(memoryview(entry.buf), entry.size)  # final once visible
        self._copy(0, p.data_start)
        self._whole = entry.done
        if entry.done:
            self._copy(p.trailer_start, p.total)
        info = codec.parse(mv, entry.size, verify_head=entry.done)
        owner._opened(1)
        try:
            self._start(mv, info, verify=True, deadline=time.monotonic() + 30.0)
        except BaseException:
            self.close()
            raise

    def _copy(self, start: int, end: int) -> None:
        self._local[start:end] = self._e.buf[start:end]
        self.moved += end - start

    def _wait(
        self, start: int, need: int, end: int, deadline: float, cancel: threading.Event | None
    ) -> int:
        e = self._e
        with _COND:
            while e.progress < need:
                if e.failed is not None:
                    raise KVTransferError(f"the producer of {self._name} failed: {e.failed}")
                check_cancel(cancel, f"the load of {self._name}")
                now = time.monotonic()
                if now >= deadline:
                    raise KVTransferTimeout(
                        f"{self._name}: {e.progress} of {e.size} bytes written by the deadline"
                    )
                _COND.wait(min(0.001, deadline - now))
            avail = min(e.progress, end)
        self._copy(start, avail)
        if not self._whole:  # the digests of the chunks written so far (counted at the end)
            p = self._info.prelude
            self._local[p.trailer_start : p.total] = e.buf[p.trailer_start : p.total]
        return avail

    def _finish(self, deadline: float, cancel: threading.Event | None) -> None:
        if self._whole:
            return
        self._wait(self.size, self.size, self.size, deadline, cancel)
        p = self._info.prelude
        self._copy(p.trailer_start, p.total)
        ck = slice(codec.CHECKSUM_OFFSET, codec.CHECKSUM_OFFSET + 8)  # written last
        self._local[ck] = self._e.buf[ck]
        assert self._mv is not None
        verify_head(self._mv, p)

    def close(self) -> None:
        if self._mv is not None or self.obj is not None:
            self._owner._opened(-1)
        super().close()


class FakeBackend(OmniConnectorBase):
    """In-process connector with chunk-verified ranged loads; see the module docstring."""

    TRANSPORT: ClassVar[str] = "in-process"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = dict(config or {})
        self.config = cfg
        self.namespace = str(cfg.get("namespace", "default"))
        self.delay_s = float(cfg.get("delay_s", 0.0))
        self.fail_puts = int(cfg.get("fail_puts", 0))
        corrupt = cfg.get("corrupt_next")
        self.corrupt_next: int | None = None if corrupt is None else int(corrupt)
        self.streaming = bool(cfg.get("streaming", False))
        self.step_s = float(cfg.get("step_s", 0.002))
        self.supports_streaming = self.streaming
        self._stats = Counters(*COMMON, "failed_puts", "discards")
        self._lock = threading.Lock()
        self._mine: set[EntryKey] = set()
        self._open_streams = 0
        self._threads: list[threading.Thread] = []
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("FakeBackend is closed; create a new one")

    def _opened(self, n: int) -> None:
        with self._lock:
            self._open_streams += n

    # -- producer ----------------------------------------------------------------------
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        self._check_open()
        if self.fail_puts > 0:
            self.fail_puts -= 1
            self._stats.add("failed_puts")
            return False, 0, None
        key = (self.namespace, str(from_stage), str(to_stage), str(put_key))
        frame = codec.encode(data)
        entry = _Entry(bytearray(frame.nbytes), frame.nbytes, time.monotonic() + self.delay_s)
        corrupt, self.corrupt_next = self.corrupt_next, None
        bad = None if corrupt is None else frame.chunks.bounds(corrupt % frame.chunks.count)
        with _COND:
            if key in _ENTRIES:
                raise KVTransferError(f"key {put_key!r} is already published and unconsumed")
            if not self.streaming:
                frame.pack_into(entry.buf)
                if bad is not None:
                    entry.buf[bad[0]] ^= 0xFF
                entry.progress, entry.done = entry.size, True
            _ENTRIES[key] = entry
            self._mine.add(key)
        if self.streaming:
            t = threading.Thread(
                target=self._pack, args=(frame, entry, bad), name="fake-pack", daemon=True
            )
            self._threads.append(t)
            t.start()
        self._stats.add("puts")
        self._stats.add("bytes_put", frame.nbytes)
        return True, frame.nbytes, {"key": put_key, "size": frame.nbytes}

    def _pack(self, frame: codec.Frame, entry: _Entry, bad: tuple[int, int] | None) -> None:
        try:
            for done in frame.iter_pack(entry.buf):
                if bad is not None and done >= bad[1]:
                    entry.buf[bad[0]] ^= 0xFF  # after its digest was written
                    bad = None
                if done > frame.data_start:
                    time.sleep(self.step_s)
                with _COND:
                    entry.progress = done
                    _COND.notify_all()
            with _COND:
                entry.done = True
                _COND.notify_all()
        except Exception as e:
            with _COND:
                entry.failed = f"{type(e).__name__}: {e}"
                _COND.notify_all()

    # -- consumer ----------------------------------------------------------------------
    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        self._check_open()
        key = (self.namespace, str(from_stage), str(to_stage), str(get_key))
        with _COND:
            e = _ENTRIES.get(key)
            if e is None or time.monotonic() < e.visible_at or e.progress == 0:
                e = None
            else:
                del _ENTRIES[key]
        if e is None:
            self._stats.add("misses")
            return None
        stream = FakeStream(e, f"{get_key}@{from_stage}->{to_stage}", self)
        self._stats.add("gets")
        self._stats.add("bytes_got", e.size)
        return stream

    def discard(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        self._check_open()
        k = (self.namespace, str(from_stage), str(to_stage), str(key))
        with _COND:
            e = _ENTRIES.pop(k, None)
        if e is None:
            return False
        self._stats.add("discards")
        return True

    # -- lifecycle -----------------------------------------------------------------------
    def cleanup(self, request_id: str) -> None:
        """Withdraw this instance's unconsumed entries of ``request_id``."""
        with _COND:
            for k in [k for k in self._mine if key_of_request(k[3], request_id)]:
                _ENTRIES.pop(k, None)
                self._mine.discard(k)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _COND:
            for k in self._mine:
                _ENTRIES.pop(k, None)
            self._mine.clear()
        for t in self._threads:
            t.join(5)

    def health(self) -> dict[str, Any]:
        with _COND:
            unconsumed = sum(1 for k in self._mine if k in _ENTRIES)
        return {
            "status": "closed" if self._closed else "healthy",
            "backend": "fake",
            "namespace": self.namespace,
            "unconsumed": unconsumed,
            "open_streams": self._open_streams,
            **self._stats.snapshot(),
        }
