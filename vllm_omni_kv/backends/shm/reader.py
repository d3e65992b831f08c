"""The reading side of the shared-memory backend: mapping producer segments, decoding
claimed index entries, and following a streamed frame while its producer writes it.

A streamed entry is published once the frame's header is written; the producer
then advances the segment's ``progress`` after every packed step, each chunk's
digest already in the trailer (see :mod:`vllm_omni_kv.backends.shm.arena` for the
file layout). :class:`ShmFrameStream` waits for that counter only as far as the
requested chunks need, verifies each chunk and hands it to the reader while the
bytes are still in the CPU cache; header and trailer are checked once the
producer marks the segment done. Relies on stores becoming visible in program
order (x86-64 TSO); the shared-memory connector streams only on such CPUs.

While a reader holds a claimed segment, a thread of its process renews the segment's
reader lease every ``HEARTBEAT_S`` (:class:`ReaderLeases`); a producer takes back a
segment whose lease went stale (its reader died). Whether a producer is alive: its pid
(in our PID namespace) or its heartbeat
(:func:`~vllm_omni_kv.backends.shm.liveness.owner_alive`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.consumer_maps import ConsumerMaps
from vllm_omni_kv.backends.shm.entry_files import inline_frame
from vllm_omni_kv.backends.shm.liveness import (
    HEARTBEAT_S,
    W_READER,
    lease_word,
    now_ms,
    owner_alive,
)
from vllm_omni_kv.errors import KVPayloadError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.digests import verify_head
from vllm_omni_kv.wire.stream import ChunkedStream, CompleteStream, PayloadStream, check_cancel


class ReaderLeases:
    """The segments this process holds as a reader, whose leases a thread renews."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], arena.Segment] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def hold(self, seg: arena.Segment, gen: int) -> None:
        """Write a fresh lease on generation ``gen`` of ``seg`` and keep renewing it."""
        seg.words()[W_READER] = lease_word(gen, now_ms())
        with self._lock:
            self._held[(seg.name, gen)] = seg
            if self._thread is None or self._pid != os.getpid():  # none yet, or forked
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, name="omnikv-shm-reader-lease", daemon=True
                )
                self._thread.start()

    def drop(self, seg: arena.Segment, gen: int) -> None:
        with self._lock:
            self._held.pop((seg.name, gen), None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def renew(self) -> None:
        """Renew every lease still on its generation; forget the others."""
        ms = now_ms()
        with self._lock:
            items = list(self._held.items())
        for (_name, gen), seg in items:
            try:
                if seg.state()[1] != gen:  # taken back and reused: no longer ours
                    self.drop(seg, gen)
                    continue
                seg.words()[W_READER] = lease_word(gen, ms)
            except (ValueError, OSError):  # mapping closed at interpreter exit
                self.drop(seg, gen)

    def _loop(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            self.renew()


#: this process's reader leases
LEASES = ReaderLeases()


def producer_alive(seg: arena.Segment, ref: Ref, maps: ConsumerMaps) -> bool:
    """Whether the producer that wrote ``seg`` is alive (its pid or heartbeat; see liveness)."""
    return owner_alive(seg.words().tolist(), ref.pid, maps.stale_s)


def peek_index(name: str) -> bytes | None:
    """The index entry ``name`` without claiming it; None when absent."""
    try:
        return arena.read_entry(name)
    except FileNotFoundError:
        return None
    except OSError as e:  # O_NOFOLLOW on a link: ELOOP
        raise KVPayloadError(f"shared-memory index entry {name} refused: {e}") from e


@dataclass
class Ref:
    """A decoded ``b"R"`` or ``b"S"`` index entry."""

    seg: str
    gen: int
    size: int
    pooled: bool
    pid: int
    stream: bool


def parse_ref(entry: bytes) -> Ref | None:
    """The segment reference of an index entry; None for an inline entry."""
    tag = entry[:1]
    if inline_frame(entry) is not None:
        return None
    if tag not in (b"R", b"S"):
        raise KVPayloadError(f"corrupt shared-memory index entry (tag {tag!r})")
    try:
        r = arena.ref_fields(entry)
        ref = Ref(r["seg"], r["gen"], r["size"], r["pooled"], r["pid"], tag == b"S")
    except Exception as e:
        raise KVPayloadError(f"corrupt shared-memory index entry: {e}") from None
    if not (
        isinstance(ref.seg, str)
        and ref.seg.startswith(arena.SEG_PREFIX)
        and "/" not in ref.seg
        and "\0" not in ref.seg
    ):
        raise KVPayloadError(f"shared-memory index points outside the arena: {ref.seg!r}")
    return ref


def map_segment(ref: Ref, maps: ConsumerMaps) -> arena.Segment:
    """The segment ``ref`` points to, checked to hold its generation; its mapping is in
    use until ``maps.release(seg.mm)`` (:func:`release_claimed` does it)."""
    try:
        mm = maps.acquire(ref.seg, pin=ref.pooled)
    except FileNotFoundError:
        raise KVTransferError(
            f"segment {ref.seg} vanished before it was read (its producer exited or was killed)"
        ) from None
    seg = arena.Segment(ref.seg, len(mm) - arena.DATA_OFFSET, mm)
    state, seg_gen = seg.state()
    if seg_gen != ref.gen or state == arena.FREE or ref.size > seg.capacity:
        maps.release(mm)
        raise KVPayloadError(
            f"segment {ref.seg} does not hold the indexed payload (generation {seg_gen}, "
            f"expected {ref.gen}): it was overwritten or the producer restarted"
        )
    return seg


def entry_complete(entry: bytes, maps: ConsumerMaps) -> bool:
    """False while the producer of a streamed entry is still writing it."""
    ref = parse_ref(entry)
    if ref is None or not ref.stream:
        return True
    try:
        seg = map_segment(ref, maps)
    except (KVPayloadError, KVTransferError):
        return True  # claiming it reports the error
    try:
        streaming = seg.state()[0] == arena.STREAMING
        return not streaming or not producer_alive(seg, ref, maps)  # dead writer: claim, report
    finally:
        maps.release(seg.mm)


def read_entry(entry: bytes, maps: ConsumerMaps, verify: bool = True) -> tuple[Any, int]:
    """Decode a claimed, complete index entry; tensors are views of the producer's segment."""
    ref = parse_ref(entry)
    if ref is None:
        body = inline_frame(entry) or b""
        return codec.decode(body, verify=verify), len(body)
    seg = map_segment(ref, maps)
    LEASES.hold(seg, ref.gen)
    state = seg.state()[0]
    if state not in (arena.PUBLISHED, arena.ONESHOT):
        release_claimed(seg, ref, maps)
        if state == arena.ABORTED:
            raise KVTransferError(f"the producer of segment {ref.seg} failed while writing it")
        if state == arena.STREAMING and not producer_alive(seg, ref, maps):
            raise KVTransferError(
                f"the producer (pid {ref.pid}) exited while writing segment {ref.seg}"
            )
        raise KVTransferError(f"segment {ref.seg} is still being written (state {state})")
    window = np.frombuffer(seg.mm, dtype=np.uint8, count=ref.size, offset=arena.DATA_OFFSET)
    try:
        obj = codec.decode(window, verify=verify)
    except BaseException:
        del window
        release_claimed(seg, ref, maps)
        raise
    # When the last view into `window` is gone, hand the segment back to its producer.
    weakref.finalize(window, release_claimed, seg, ref, maps)
    return obj, ref.size


def release_claimed(
    seg: arena.Segment, ref: Ref, maps: ConsumerMaps, dead: list[bool] | None = None
) -> None:
    """Hand a claimed segment back: free it when its producer is done, else abandon it.

    ``dead[0]`` true (a stream saw its writer exit) always abandons: a writer that
    only looked dead frees it itself, and sweeping removes a dead one's files.
    Leaves it alone once it no longer holds ``ref``'s generation in a claimed
    state (someone else released it, or its producer reserved it again). Ends the
    reader's use of the mapping (:meth:`ConsumerMaps.release`).
    """
    LEASES.drop(seg, ref.gen)
    try:
        state, gen = seg.state()
        if gen != ref.gen:
            return
        if (dead is not None and dead[0]) or (ref.stream and state == arena.STREAMING):
            seg.abandon(ref.gen)  # the producer frees it when it finishes
        elif not ref.pooled or state in (arena.PUBLISHED, arena.ABORTED):
            _give_back(seg, ref.pooled, maps)
    except (ValueError, OSError):  # mapping already closed at interpreter exit
        pass
    finally:
        maps.release(seg.mm)


def _give_back(seg: arena.Segment, pooled: bool, maps: ConsumerMaps) -> None:
    try:
        if pooled:
            seg.set_state(arena.FREE, seg.state()[1])
        else:
            maps.drop(seg.name)
            arena.unlink_quiet(seg.name)
    except (ValueError, OSError):  # mapping already closed at interpreter exit
        pass


#: spin this long on an idle counter before sleeping between checks (seconds)
SPIN_S = 0.0005
#: longest sleep between checks of an idle counter (seconds)
MAX_NAP_S = 0.001
#: how often a waiting reader checks that the producer process is alive (seconds)
ALIVE_EVERY_S = 0.05


class ShmFrameStream(ChunkedStream):
    """A claimed entry read in place; ``load`` verifies just the chunks it hands out.

    For a streamed entry ``load`` follows the producer's ``progress`` only as far as
    the requested chunks need, and checks header and trailer once the producer
    finished; a complete entry has them checked when the stream opens. ``moved``
    counts header, trailer and the chunk bytes read. The segment goes back to its
    producer when the stream is closed and the last tensor view of ``obj`` is gone
    (as for ``get``), so views stay valid as long as they are referenced.
    """

    count_chunks = True

    def __init__(self, seg: arena.Segment, ref: Ref, maps: ConsumerMaps, verify: bool) -> None:
        self._seg, self._ref, self._maps = seg, ref, maps
        LEASES.hold(seg, ref.gen)
        self._dead = [False]
        self._check_head = verify
        window = np.frombuffer(seg.mm, dtype=np.uint8, count=ref.size, offset=arena.DATA_OFFSET)
        # runs when the stream is closed and the last view of its frame is gone
        weakref.finalize(window, release_claimed, seg, ref, maps, self._dead)
        self.frame_address = int(window.ctypes.data)
        try:
            if not ref.stream:
                self._check(*seg.state())
            # A streamed frame's prelude and header are final before its entry is
            # published (the producer later writes only the checksum field); its
            # trailer is checked once the producer is done.
            mv = memoryview(window.data)
            p = codec.read_prelude(mv, ref.size)
            if verify and p.alg != codec.CHECKSUM_XXH3:
                raise KVPayloadError("shared-memory frame carries no checksum")
            info = codec.parse(mv, ref.size, verify_head=verify and not ref.stream)
            self.moved = info.data_start + (0 if ref.stream else p.trailer_len)
            self._start(mv, info, verify=verify, deadline=time.monotonic() + 30.0)
        except BaseException:
            self.close()
            raise

    def _wait(
        self, start: int, need: int, end: int, deadline: float, cancel: threading.Event | None
    ) -> int:
        if not self._ref.stream:
            return end
        idle_since = time.monotonic()
        nap = 0.00002
        next_alive = idle_since + ALIVE_EVERY_S
        while True:
            state, gen, progress, _ab = self._seg.full_state()
            self._check(state, gen)
            if progress >= need:
                return min(progress, end)
            check_cancel(cancel, f"reading segment {self._ref.seg}")
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(progress)
            if now >= next_alive:
                next_alive = now + ALIVE_EVERY_S
                if not producer_alive(self._seg, self._ref, self._maps):
                    self._dead[0] = True
                    raise KVTransferError(
                        f"the producer (pid {self._ref.pid}) exited while writing segment "
                        f"{self._ref.seg} ({progress} of {self.size} bytes written)"
                    )
            if now - idle_since > SPIN_S:
                time.sleep(min(nap, deadline - now))
                nap = min(nap * 2, MAX_NAP_S)

    def _finish(self, deadline: float, cancel: threading.Event | None) -> None:
        if not self._ref.stream:
            return
        self._wait(self.size, self.size, self.size, deadline, cancel)  # the producer is done
        assert self._mv is not None
        if self._check_head:
            verify_head(self._mv, self._info.prelude)
        self.moved += self._info.prelude.trailer_len

    def _check(self, state: int, gen: int) -> None:
        ok = (
            (arena.STREAMING, arena.PUBLISHED, arena.ABORTED)
            if self._ref.stream
            else (
                arena.PUBLISHED,
                arena.ONESHOT,
            )
        )
        if gen != self._ref.gen or state not in ok:
            raise KVPayloadError(
                f"segment {self._ref.seg} was released or reused while being read (state "
                f"{state}, generation {gen}, expected {self._ref.gen})"
            )
        if state == arena.ABORTED:
            raise KVTransferError(
                f"the producer of segment {self._ref.seg} failed while writing it"
            )

    def _timeout(self, written: int) -> KVTransferTimeout:
        return KVTransferTimeout(
            f"the producer of segment {self._ref.seg} wrote {written} of {self.size} bytes "
            "before the deadline"
        )


def open_entry_stream(entry: bytes, maps: ConsumerMaps, verify: bool) -> PayloadStream:
    """A stream over a claimed index entry (inline entries give a ``CompleteStream``)."""
    ref = parse_ref(entry)
    if ref is None:  # the frame is the entry's body: keep it so the stream can be authenticated
        return CompleteStream(*read_entry(entry, maps, verify=verify), frame=inline_frame(entry))
    seg = map_segment(ref, maps)
    if not ref.stream and seg.state()[0] not in (arena.PUBLISHED, arena.ONESHOT):
        maps.release(seg.mm)  # read_entry maps it again
        return CompleteStream(*read_entry(entry, maps, verify=verify))  # reports why
    return ShmFrameStream(seg, ref, maps, verify)
