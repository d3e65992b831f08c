"""The producer's half of NIXL's WRITE direction: running writes for proven sinks.

Sinks (who may be written to, their tokens and table sets) are kept by
:class:`~.sinks.Sinks`; table sets, writes and aborts for a sink must carry its token. A
``nixl_write`` is checked against the sink's registered ranges and this agent's, made
from prepared lists (pages) or descriptors (ranges) and posted with the notification
``D`` + nonce (NIXL delivers it after the bytes), and answered at once; a write of
:data:`POST_HERE_MAX` bytes or more is made and posted on the :class:`~.poster.Poster`'s
thread instead, as posting may copy its bytes. A write that cannot be made or posted is
told to its sink: ``E`` + nonce. A reaper
thread releases each write when it ends; one that fails is released and its sink told
``E`` + nonce. A running write is never released (that does not stop its bytes over every
transport): ``nixl_write_abort`` answers ``running`` until it ended (``aborted`` for one
still waiting to be posted, which then never is), and one that outruns its ``ttl_s`` is
logged and waited for. The nonce of a write aborted before it was seen is remembered, so a
late request with it is refused. A write's handle is checked and released only under its
own lock, once: the reaper and an abort never touch a released handle. Bounded:
:data:`MAX_RUNNING` (and :data:`MAX_RUNNING_PER_SINK`, writes waiting to be posted
included), :data:`MAX_TOMBS`, and the bounds of :mod:`.sinks`.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni_kv.backends.backoff import Backoff
from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.memory import Kind, Span, kind_of, tables_kind, use_device
from vllm_omni_kv.backends.nixl.poster import Poster
from vllm_omni_kv.backends.nixl.prepared_lists import LOCAL_SIDE, PreparedLists
from vllm_omni_kv.backends.nixl.sinks import Sinks, TableSet
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.logger import LogBudget, init_logger

logger = init_logger(__name__)
#: failed writes (a sink can ask for writes that fail at the side channel's rate)
_failed_writes = LogBudget(logger)

MAX_RUNNING = 1024
MAX_RUNNING_PER_SINK = 256
MAX_TOMBS = 4096
#: writes of fewer bytes are posted on the side-channel thread (a hand-off to the poster
#: costs more than their copy); larger ones on the poster's
POST_HERE_MAX = 4 << 20
TOMB_S = 600.0


@dataclass
class _Running:
    handle: Any
    sink: str
    token: bytes
    deadline: float
    kind: Kind  # the source memory's (its device is made current to check or abort it)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False

    def state(self, agent: Any) -> str:
        """NIXL's state of the write; ``RELEASED`` once its handle was released."""
        with self.lock:
            if self.released:
                return "RELEASED"
            use_device(self.kind)
            try:
                return str(agent.check_xfer_state(self.handle))
            except Exception:
                return "ERR"

    def release(self) -> bool:
        """Release the handle once; False where NIXL refused. Only for a write that is not
        ``PROC`` (or at close): releasing a running one does not stop its bytes over
        every transport (UCX over TCP lands them all)."""
        with self.lock:
            if not self.released:
                use_device(self.kind)
                self.released = _release(self.handle)
            return self.released


class Writer:
    """Serves the WRITE ops for one agent. ``spans()`` lists this agent's registered
    ranges; ``unload(name)`` drops a remote agent this half loaded (unless it is in use)."""

    def __init__(
        self,
        agent: Any,
        prepared: PreparedLists,
        spans: Callable[[], list[Span]],
        unload: Callable[[str], None],
    ) -> None:
        self._agent, self._prepared, self._spans = agent, prepared, spans
        self._sinks = Sinks(agent, prepared, unload)
        self._lock = threading.Condition()
        self._running: dict[bytes, _Running] = {}
        self._tombs: OrderedDict[bytes, float] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._poster = Poster(self._posted)  # makes and posts the writes accepted here
        self._added = 0  # writes tracked so far: a new one restarts the reaper's backoff
        self._closed = False

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if self._closed:
            return {"ok": False, "reason": "error", "error": "the NIXL agent is closing"}
        if op == ww.SINK_OP:
            proof = ww.parse_proof(msg)
            return self._sinks.request(msg) if proof is None else self._sinks.prove(*proof)
        if op == ww.TABLES_OP:
            return self._sinks.add_tables(msg)
        if op == ww.WRITE_OP:
            return self._write(ww.parse_write(msg))
        return self._abort(msg)

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a sink here, or asked to be one (its metadata stays loaded)."""
        return self._sinks.holds(name)

    # -- writes ----------------------------------------------------------------------
    def _write(self, req: ww.WriteRequest) -> dict[str, Any]:
        sink = self._sinks.of(req.agent, req.token)
        if sink is None:
            return {"ok": False, "reason": "need_sink"}
        tset = self._sinks.tables(req.agent, req.pages.tables) if req.pages else None
        if req.pages is not None and tset is None:
            return {"ok": False, "reason": "need_tables"}
        with self._lock:
            used = req.nonce in self._tombs or req.nonce in self._running
            if used or self._poster.state(req.nonce) is not None:
                return {"ok": False, "reason": "error", "error": "nonce already used"}
            mine = sum(1 for r in self._running.values() if r.sink == req.agent)
            mine += self._poster.count(req.agent)
            all_ = len(self._running) + self._poster.count()
            if all_ >= MAX_RUNNING or mine >= MAX_RUNNING_PER_SINK:
                return {"ok": False, "reason": "busy"}
        notif = b"D" + req.nonce
        if req.pages is not None and tset is not None:
            make, kind = self._pages(req.agent, sink.spans, req.pages, tset, notif)
            nbytes = (
                len(req.pages.layers) * len(req.pages.pairs) * max(t.page_bytes for t in tset[0])
            )
        else:
            assert req.ranges is not None
            make, kind = self._ranges(req.agent, sink.spans, req.ranges, notif)
            nbytes = int(req.ranges[:, 2].sum())
        if nbytes < POST_HERE_MAX:  # copied (if at all) in well under a millisecond
            self._posted(req.nonce, (req, make, kind))
        else:
            self._poster.submit(req.nonce, req.agent, (req, make, kind))
        return {"ok": True}

    def _pages(
        self, name: str, sink: list[Span], g: ww.PageGroup, tset: TableSet, notif: bytes
    ) -> tuple[Callable[[], Any], Kind]:
        src, dst = tset
        s_ids, d_ids = ww.page_ids(g, src, dst)
        skind, dkind = tables_kind(self._spans(), src), tables_kind(sink, dst)
        if skind is None or dkind is None:
            raise KVTransferError("a page table is outside the registered memory of its side")
        s32, d32 = s_ids.astype(np.int32), d_ids.astype(np.int32)
        sides = [(LOCAL_SIDE, skind, src), (name, dkind, dst)]

        def make() -> Any:
            return self._prepared.request(
                self._agent,
                sides,
                lambda h: self._agent.make_prepped_xfer("WRITE", h[0], s32, h[1], d32, notif),
            )

        return make, skind

    def _ranges(
        self, name: str, sink: list[Span], rows: np.ndarray, notif: bytes
    ) -> tuple[Callable[[], Any], Kind]:
        ours = self._spans()
        triples = [(int(d), int(s), int(n)) for d, s, n in rows.tolist()]
        skinds = {kind_of(ours, s, n) for _d, s, n in triples}
        dkinds = {kind_of(sink, d, n) for d, _s, n in triples}
        skind, dkind = (
            (skinds.pop() if len(skinds) == 1 else None),
            (dkinds.pop() if len(dkinds) == 1 else None),
        )
        if skind is None or dkind is None:
            raise KVTransferError("a range is outside (or spans kinds of) registered memory")
        (smem, sdev), (dmem, ddev) = skind, dkind

        def make() -> Any:
            local = self._agent.get_xfer_descs([(s, n, sdev) for _d, s, n in triples], smem)
            remote = self._agent.get_xfer_descs([(d, n, ddev) for d, _s, n in triples], dmem)
            return self._agent.initialize_xfer("WRITE", local, remote, name, notif)

        return make, (smem, sdev)

    def _posted(self, nonce: bytes, job: tuple[ww.WriteRequest, Callable[[], Any], Kind]) -> None:
        """Make and post one write (on the poster's thread) and track it. A post that
        failed once its handle existed is tracked too unless its handle is released: NIXL
        may have posted part of it, so the sink's abort must find it (the reaper tells the
        sink once it ended). A write that failed with nothing running is told ``E`` now."""
        req, make, kind = job
        use_device(kind)  # the source's device: this thread posts on its context
        try:
            handle = make()
        except Exception as e:
            self._failed(req, f"could not be made: {e}")
            return
        try:
            state, why = str(self._agent.transfer(handle)), "ERR"
        except Exception as e:
            state, why = "ERR", str(e)
        if state != "ERR" or not _release(handle):
            self._track(req, handle, kind)
        else:
            self._failed(req, f"could not be posted: {why}")

    def _failed(self, req: ww.WriteRequest, why: str) -> None:
        """A write of which nothing runs failed: its nonce is spent and its sink told."""
        with self._lock:
            self._tomb(req.nonce)
        self._tell_failed(req.agent, req.nonce, why)

    def _tell_failed(self, sink: str, nonce: bytes, why: str) -> None:
        """Notify ``sink`` that its write ``nonce`` failed (``E`` + nonce)."""
        _failed_writes.warning("a NIXL write to %s %s; the sink is told", sink, why)
        try:
            self._agent.send_notif(sink, b"E" + nonce)
        except Exception as e:
            logger.debug("NIXL could not tell %s of a failed write: %s", sink, e)

    def _track(self, req: ww.WriteRequest, handle: Any, kind: Kind) -> None:
        with self._lock:
            deadline = time.monotonic() + req.ttl_s
            self._running[req.nonce] = _Running(handle, req.agent, req.token, deadline, kind)
            self._added += 1
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="omnikv-nixl-writes")
                self._reaper.daemon = True
                self._reaper.start()
            self._lock.notify()

    def _abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        nonce, agent, token = ww.nonce_of(msg), ww.agent_of(msg), ww.token_of(msg)
        known = self._sinks.of(agent, token) is not None
        with self._lock:
            run = self._running.get(nonce)
            queued = self._poster.state(nonce)
            if run is None and queued == "posting":
                return {"ok": True, "state": "running"}  # tracked once its post returns
            if (
                run is None
                and queued == "waiting"
                and known
                and self._poster.withdraw(nonce, agent)
            ):
                self._tomb(nonce)
                return {"ok": True, "state": "aborted"}  # never posted
            if run is None:  # not seen (yet): refused when it comes, if its sink sent this
                if known:
                    self._tomb(nonce)
                return {"ok": True, "state": "unknown"}
            if run.sink != agent or not hmac.compare_digest(run.token, token):
                return {"ok": False, "reason": "error", "error": "not a write of this sink"}
        state = run.state(self._agent)
        if state == "PROC":  # it cannot be stopped: its sink waits for its end
            return {"ok": True, "state": "running"}
        with self._lock:
            self._running.pop(nonce, None)
            self._tomb(nonce)
        run.release()
        return {"ok": True, "state": "done" if state == "DONE" else "aborted"}

    def _tomb(self, nonce: bytes) -> None:
        now = time.monotonic()
        self._tombs[nonce] = now + TOMB_S
        while self._tombs and (
            len(self._tombs) > MAX_TOMBS or next(iter(self._tombs.values())) < now
        ):
            self._tombs.popitem(last=False)

    # -- the reaper ------------------------------------------------------------------
    def _reap(self) -> None:
        backoff, seen = Backoff(), 0
        while True:
            with self._lock:
                while not self._running and not self._closed:
                    self._lock.wait(0.5)
                if self._closed:
                    return
                if self._added != seen:  # new work: poll it as closely as a fresh wait
                    seen = self._added
                    backoff.reset()
                runs = list(self._running.items())
            for nonce, run in runs:
                self._settle(nonce, run, run.state(self._agent))
            backoff.sleep()

    def _settle(self, nonce: bytes, run: _Running, state: str) -> None:
        if state == "PROC" and time.monotonic() > run.deadline:
            run.deadline = float("inf")  # warned once; it is waited for to its end
            logger.warning("a NIXL write to %s outran its ttl_s; waiting for its end", run.sink)
        if state in ("RELEASED", "PROC"):
            return  # an abort ended its entry, or it still runs
        with self._lock:
            if self._running.pop(nonce, None) is None:
                return  # aborted meanwhile
        run.release()
        if state != "DONE":
            self._tell_failed(run.sink, nonce, f"ended {state}")

    def close(self) -> None:
        """Abort every running write (its sink's wait ends by its own deadline) and let go
        of the agent."""
        self._poster.close()
        with self._lock:
            self._closed = True
            runs, self._running = list(self._running.values()), {}
            self._lock.notify_all()
        for run in runs:
            run.release()
        if self._reaper is not None:
            self._reaper.join(timeout=2.0)
        # no reference to the agent outlives its engine's close (its UCX progress thread
        # busy-polls until the agent is destroyed)
        self._agent = None
        self._spans = _nothing
        self._sinks.close()


def _nothing(*_a: Any) -> Any:
    return []


def _release(handle: Any) -> bool:
    """Release a transfer handle (NIXL aborts a running one); False where it refused."""
    try:
        handle.release()
    except Exception as e:
        logger.debug("releasing a NIXL write: %s", e)
        return False
    return True
