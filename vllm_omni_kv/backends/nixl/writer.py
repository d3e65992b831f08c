"""The producer's half of NIXL's WRITE direction: proven sinks, table sets, running writes.

A consumer becomes a *sink* in two steps (:mod:`.write_wire`): its metadata is loaded and
a challenge is sent to the agent it names as a NIXL notification; the consumer's echo of
the challenge proves it is that agent, and stays its token: table sets, writes and aborts
for the sink must carry it. A ``nixl_write`` is then checked against the sink's
registered ranges and this agent's, made from prepared lists (pages) or descriptors
(ranges), posted with the notification ``D`` + nonce (NIXL delivers it after the bytes),
and answered at once. A reaper thread releases each write when it ends; one that fails or
outruns its ``ttl_s`` is aborted and its sink told ``E`` + nonce. ``nixl_write_abort``
stops a write; the nonce of one not (yet) seen is remembered, so a late request with it is
refused. A write's handle is checked and released only under its own lock, once: the
reaper and an abort never touch a released handle. Everything is bounded:
:data:`MAX_SINKS`, :data:`MAX_PENDING`, :data:`MAX_SETS`, :data:`MAX_RUNNING` (and
:data:`MAX_RUNNING_PER_SINK`), :data:`MAX_TOMBS`.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.backoff import Backoff
from vllm_omni_kv.backends.nixl.handshake import add_agent
from vllm_omni_kv.backends.nixl.memory import Span, kind_of, tables_kind
from vllm_omni_kv.backends.nixl.prepared_lists import LOCAL_SIDE, PreparedLists
from vllm_omni_kv.backends.pull.page_reads import PageTable
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

MAX_SINKS = 256
MAX_PENDING = 64
PENDING_S = 30.0
MAX_SETS = 256
MAX_RUNNING = 1024
MAX_RUNNING_PER_SINK = 256
MAX_TOMBS = 4096
TOMB_S = 600.0

TableSet = tuple[tuple[PageTable, ...], tuple[PageTable, ...]]


@dataclass
class _Sink:
    spans: list[Span]
    token: bytes  # the challenge of its proof


@dataclass
class _Running:
    handle: Any
    sink: str
    token: bytes
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False

    def state(self, agent: Any) -> str:
        """NIXL's state of the write; ``RELEASED`` once its handle was released."""
        with self.lock:
            if self.released:
                return "RELEASED"
            try:
                return str(agent.check_xfer_state(self.handle))
            except Exception:
                return "ERR"

    def release(self) -> bool:
        """Release the handle once (NIXL aborts a running write); False where it refused."""
        with self.lock:
            if not self.released:
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
        self._agent, self._prepared, self._spans, self._unload = agent, prepared, spans, unload
        self._lock = threading.Condition()
        self._sinks: OrderedDict[str, _Sink] = OrderedDict()
        self._pending: OrderedDict[str, tuple[list[Span], bytes, float]] = OrderedDict()
        self._sets: OrderedDict[tuple[str, bytes], TableSet] = OrderedDict()
        self._running: dict[bytes, _Running] = {}
        self._tombs: OrderedDict[bytes, float] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._closed = False

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if self._closed:
            return {"ok": False, "reason": "error", "error": "the NIXL agent is closing"}
        if op == ww.SINK_OP:
            return self._sink(msg)
        if op == ww.TABLES_OP:
            return self._table_set(msg)
        if op == ww.WRITE_OP:
            return self._write(ww.parse_write(msg))
        return self._abort(msg)

    # -- sinks and table sets --------------------------------------------------------
    def _sink(self, msg: dict[str, Any]) -> dict[str, Any]:
        proof = ww.parse_proof(msg)
        if proof is not None:
            with self._lock:
                entry = self._pending.get(proof[0])
                if entry is None or entry[1] != proof[1] or entry[2] < time.monotonic():
                    return {"ok": False, "reason": "error", "error": "no such challenge"}
                del self._pending[proof[0]]
                self._sinks[proof[0]] = _Sink(entry[0], entry[1])
                evicted = (
                    self._sinks.popitem(last=False)[0] if len(self._sinks) > MAX_SINKS else None
                )
            self._drop(evicted)
            return {"ok": True}
        name, md, spans = ww.parse_sink(msg)
        self._load(name, md)
        challenge = os.urandom(ww.NONCE_BYTES)
        with self._lock:
            self._pending[name] = (spans, challenge, time.monotonic() + PENDING_S)
            self._pending.move_to_end(name)
            stale = (
                self._pending.popitem(last=False)[0] if len(self._pending) > MAX_PENDING else None
            )
        if stale is not None and stale not in self._sinks:
            self._unload(stale)
        try:
            self._agent.send_notif(name, b"C" + challenge)
        except Exception as e:
            raise KVTransferError(f"cannot reach NIXL agent {name!r} to prove it: {e}") from None
        return {"ok": True, "challenged": True}

    def _load(self, name: str, md: bytes) -> None:
        try:
            add_agent(self._agent, md, name, f"a nixl_sink request for {name!r}", self._stray)
        except KVTransferError:
            self._stray(name)
            raise

    def _stray(self, name: str) -> None:
        """Unload ``name`` (loaded by a failed ``nixl_sink``) unless it is a sink here."""
        with self._lock:
            known = name in self._sinks or name in self._pending
        if not known:
            self._unload(name)

    def _sink_of(self, agent: str, token: bytes) -> _Sink | None:
        """The proven sink ``agent`` if ``token`` is its token (under the lock)."""
        sink = self._sinks.get(agent)
        return sink if sink is not None and hmac.compare_digest(sink.token, token) else None

    def _table_set(self, msg: dict[str, Any]) -> dict[str, Any]:
        name, tid, src, dst = ww.parse_tables(msg)
        token = ww.token_of(msg)
        with self._lock:
            if self._sink_of(name, token) is None:
                return {"ok": False, "reason": "need_sink"}
            self._sets[(name, tid)] = (src, dst)
            self._sets.move_to_end((name, tid))
            while len(self._sets) > MAX_SETS:
                self._sets.popitem(last=False)
        return {"ok": True}

    def _drop(self, sink: str | None) -> None:
        if sink is None:
            return
        with self._lock:
            for key in [k for k in self._sets if k[0] == sink]:
                del self._sets[key]
        self._prepared.drop(self._agent, sink)
        self._unload(sink)

    # -- writes ----------------------------------------------------------------------
    def _write(self, req: ww.WriteRequest) -> dict[str, Any]:
        with self._lock:
            sink = self._sink_of(req.agent, req.token)
            if sink is None:
                return {"ok": False, "reason": "need_sink"}
            self._sinks.move_to_end(req.agent)
            if req.nonce in self._tombs or req.nonce in self._running:
                return {"ok": False, "reason": "error", "error": "nonce already used"}
            mine = sum(1 for r in self._running.values() if r.sink == req.agent)
            if len(self._running) >= MAX_RUNNING or mine >= MAX_RUNNING_PER_SINK:
                return {"ok": False, "reason": "busy"}
            tset = self._sets.get((req.agent, req.pages.tables)) if req.pages else None
            if req.pages is not None and tset is None:
                return {"ok": False, "reason": "need_tables"}
        notif = b"D" + req.nonce
        if req.pages is not None and tset is not None:
            make = self._pages(req.agent, sink.spans, req.pages, tset, notif)
        else:
            assert req.ranges is not None
            make = self._ranges(req.agent, sink.spans, req.ranges, notif)
        self._post(req, make)
        return {"ok": True}

    def _pages(
        self, name: str, sink: list[Span], g: ww.PageGroup, tset: TableSet, notif: bytes
    ) -> Callable[[], Any]:
        src, dst = tset
        s_ids, d_ids = ww.page_ids(g, src, dst)
        skind, dkind = tables_kind(self._spans(), src), tables_kind(sink, dst)
        if skind is None or dkind is None:
            raise KVTransferError("a page table is outside the registered memory of its side")
        local = self._prepared.get(self._agent, LOCAL_SIDE, skind, src)
        remote = self._prepared.get(self._agent, name, dkind, dst)
        s32, d32 = s_ids.astype(np.int32), d_ids.astype(np.int32)

        def make() -> Any:
            with self._prepared.using():
                return self._agent.make_prepped_xfer("WRITE", local, s32, remote, d32, notif)

        return make

    def _ranges(
        self, name: str, sink: list[Span], rows: np.ndarray, notif: bytes
    ) -> Callable[[], Any]:
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

        return make

    def _post(self, req: ww.WriteRequest, make: Callable[[], Any]) -> None:
        """Post one write and track it. A post that failed once its handle existed is
        tracked too unless its handle is released: NIXL may have posted part of it, so the
        sink's abort must find it (the reaper releases it)."""
        try:
            handle = make()
        except Exception as e:
            raise KVTransferError(f"NIXL could not make a write to {req.agent!r}: {e}") from None
        try:
            state, why = str(self._agent.transfer(handle)), "ERR"
        except Exception as e:
            state, why = "ERR", str(e)
        if state != "ERR" or not _release(handle):
            self._track(req, handle)
        if state == "ERR":
            raise KVTransferError(f"NIXL could not post a write to {req.agent!r}: {why}")

    def _track(self, req: ww.WriteRequest, handle: Any) -> None:
        with self._lock:
            deadline = time.monotonic() + req.ttl_s
            self._running[req.nonce] = _Running(handle, req.agent, req.token, deadline)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="omnikv-nixl-writes")
                self._reaper.daemon = True
                self._reaper.start()
            self._lock.notify()

    def _abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        nonce, agent, token = ww.nonce_of(msg), ww.agent_of(msg), ww.token_of(msg)
        with self._lock:
            run = self._running.get(nonce)
            if run is None:  # not seen (yet): refused when it comes, if its sink sent this
                if self._sink_of(agent, token) is not None:
                    self._tomb(nonce)
                return {"ok": True, "state": "unknown"}
            if run.sink != agent or not hmac.compare_digest(run.token, token):
                return {"ok": False, "reason": "error", "error": "not a write of this sink"}
        state = run.state(self._agent)
        if state == "PROC" and not run.release():
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
        backoff = Backoff()
        while True:
            with self._lock:
                while not self._running and not self._closed:
                    self._lock.wait(0.5)
                    backoff.reset()
                if self._closed:
                    return
                runs = list(self._running.items())
            for nonce, run in runs:
                self._settle(nonce, run, run.state(self._agent))
            backoff.sleep()

    def _settle(self, nonce: bytes, run: _Running, state: str) -> None:
        if state == "RELEASED" or (state == "PROC" and time.monotonic() < run.deadline):
            return  # an abort released it (and ends its entry), or it still runs
        if state != "DONE" and not run.release():
            run.deadline = time.monotonic() + 0.1  # cannot abort yet: try again shortly
            return
        with self._lock:
            if self._running.pop(nonce, None) is None:
                return  # aborted meanwhile
        if state == "DONE":
            run.release()
            return
        logger.warning("NIXL write to %s ended %s; the sink is told", run.sink, state)
        try:
            self._agent.send_notif(run.sink, b"E" + nonce)
        except Exception as e:
            logger.debug("NIXL could not tell %s of a failed write: %s", run.sink, e)

    def close(self) -> None:
        """Abort every running write (its sink's wait ends by its own deadline) and let go
        of the agent."""
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
        self._spans = self._unload = _nothing


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
