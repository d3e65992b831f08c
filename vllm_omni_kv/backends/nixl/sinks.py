"""The producer's proven sinks in NIXL's WRITE direction: who may be written to, and how.

A consumer asks to become a *sink* (``nixl_sink`` with its metadata and spans). The
producer loads that metadata into its agent, so that NIXL reaches the agent it names, and
sends it a notification with a fresh challenge and the request's digest
(:func:`~.write_wire.sink_digest`); the echo of the challenge (``nixl_sink`` ``{proof}``)
makes it a sink, and the challenge stays its token. What is kept:

- per name, the digest of the metadata this producer loaded last. A proof is accepted only
  while the metadata its challenge was sent through is still the loaded one, so the agent
  that answered is the agent that writes will reach;
- a proven sink's metadata is replaced (loaded again) only by a request carrying the sink's
  token: a client that copied or forged metadata naming the sink can neither redirect its
  writes nor make the producer drop them. Lists prepared over replaced metadata, and the
  sink's table sets, are dropped;
- pending proofs keyed by challenge, so requests naming the same agent do not replace one
  another; at most :data:`MAX_PENDING`, each for :data:`PENDING_S`.

Bounded: :data:`MAX_SINKS`, :data:`MAX_PENDING`, :data:`MAX_SETS`, and the metadata loads
per second (:data:`LOAD_RATE`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.handshake import add_agent
from vllm_omni_kv.backends.nixl.memory import Span
from vllm_omni_kv.backends.nixl.prepared_lists import PreparedLists
from vllm_omni_kv.backends.pull.page_reads import PageTable
from vllm_omni_kv.backends.rate import TokenBucket
from vllm_omni_kv.errors import KVTransferError

MAX_SINKS = 256
MAX_PENDING = 64
PENDING_S = 30.0
MAX_SETS = 256
#: metadata loads per second at most, past a burst of :data:`MAX_PENDING` (beyond: ``busy``).
#: NIXL 1.5 keeps sockets open for every remote agent loaded and removed again, so
#: ``nixl_sink`` requests under fresh names would otherwise take the producer's file
#: descriptors at the rate of the side channel
LOAD_RATE = 2.0

TableSet = tuple[tuple[PageTable, ...], tuple[PageTable, ...]]


@dataclass
class Sink:
    spans: list[Span]
    token: bytes  # the challenge of its proof


@dataclass
class _Pending:
    name: str
    spans: list[Span]
    md: bytes  # digest of the metadata the challenge was sent through
    deadline: float


def _md_digest(md: bytes) -> bytes:
    return hashlib.blake2b(md, digest_size=16).digest()


def _refused(why: str) -> dict[str, Any]:
    return {"ok": False, "reason": "error", "error": why}


class Sinks:
    """Sinks of one agent. ``unload(name)`` drops a remote agent loaded here (unless the
    engine uses it otherwise)."""

    def __init__(self, agent: Any, prepared: PreparedLists, unload: Callable[[str], None]):
        self._agent, self._prepared, self._unload = agent, prepared, unload
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one metadata decision (check, load) at a time
        self._sinks: OrderedDict[str, Sink] = OrderedDict()
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()  # challenge -> proof
        self._loaded: dict[str, bytes] = {}  # name -> digest of the metadata loaded last
        self._sets: OrderedDict[tuple[str, bytes], TableSet] = OrderedDict()
        self._loads = TokenBucket(LOAD_RATE, MAX_PENDING)  # metadata loads (under _loading)

    # -- asking and proving ----------------------------------------------------------
    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A ``nixl_sink`` metadata request: load it where allowed, send the challenge."""
        name, md, spans, tokens = ww.parse_sink(msg)
        digest = _md_digest(md)
        challenge = os.urandom(ww.NONCE_BYTES)
        with self._loading:
            with self._lock:
                sink, loaded = self._sinks.get(name), self._loaded.get(name)
            if loaded != digest:
                if sink is not None and not any(hmac.compare_digest(t, sink.token) for t in tokens):
                    return _refused("a proven sink's metadata changes only with its token")
                if not self._loads.take():
                    return {"ok": False, "reason": "busy"}
                self._load(name, md, digest)
            with self._lock:
                deadline = time.monotonic() + PENDING_S
                self._pending[challenge] = _Pending(name, spans, digest, deadline)
                over = len(self._pending) > MAX_PENDING
                stale = self._pending.popitem(last=False)[1] if over else None
        if stale is not None:
            self._unload_unknown(stale.name)
        try:
            self._agent.send_notif(name, ww.challenge_notif(challenge, ww.sink_digest(md, spans)))
        except Exception as e:
            raise KVTransferError(f"cannot reach NIXL agent {name!r} to prove it: {e}") from None
        return {"ok": True, "challenged": True}

    def prove(self, name: str, challenge: bytes) -> dict[str, Any]:
        """A proof: ``name`` becomes a sink with ``challenge`` as its token, if the
        metadata the challenge went through is still the one loaded."""
        with self._loading, self._lock:
            entry = self._pending.get(challenge)
            if entry is None or entry.name != name or entry.deadline < time.monotonic():
                return _refused("no such challenge")
            del self._pending[challenge]
            changed = self._loaded.get(name) != entry.md
            if not changed:
                self._sinks[name] = Sink(entry.spans, challenge)
                self._sinks.move_to_end(name)
            evicted = self._sinks.popitem(last=False)[0] if len(self._sinks) > MAX_SINKS else None
        if changed:  # its metadata goes too unless another request for the name waits
            self._unload_unknown(name)
            return _refused("the agent's metadata changed since the challenge: ask again")
        if evicted is not None:
            self._drop_lists(evicted)
            self._unload_unknown(evicted)
        return {"ok": True}

    def _load(self, name: str, md: bytes, digest: bytes) -> None:
        """Load ``md`` (it must name ``name``); lists made over what it replaces go."""
        where = f"a nixl_sink request for {name!r}"
        try:
            add_agent(self._agent, md, name, where, self._unload_unknown)
        except KVTransferError:
            self._unload_unknown(name)
            raise
        with self._lock:
            replaced = self._loaded.get(name) is not None
            self._loaded[name] = digest
        if replaced:
            self._drop_lists(name)

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a sink or a pending proof here."""
        with self._lock:
            return self._known(name)

    def _known(self, name: str) -> bool:
        return name in self._sinks or any(p.name == name for p in self._pending.values())

    def _unload_unknown(self, name: str) -> None:
        """Unload ``name`` unless it is a sink or a pending proof here."""
        with self._lock:
            if self._known(name):
                return
            self._loaded.pop(name, None)
        self._unload(name)

    def _drop_lists(self, name: str) -> None:
        """Forget ``name``'s table sets and release the lists prepared over its memory."""
        with self._lock:
            for key in [k for k in self._sets if k[0] == name]:
                del self._sets[key]
        self._prepared.drop(self._agent, name)

    # -- using a sink ----------------------------------------------------------------
    def of(self, name: str, token: bytes) -> Sink | None:
        """The sink ``name`` if ``token`` is its token (it becomes the most recently used)."""
        with self._lock:
            sink = self._sinks.get(name)
            if sink is None or not hmac.compare_digest(sink.token, token):
                return None
            self._sinks.move_to_end(name)
            return sink

    def add_tables(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A ``nixl_tables`` request of a sink (with its token)."""
        name, tid, src, dst = ww.parse_tables(msg)
        if self.of(name, ww.token_of(msg)) is None:
            return {"ok": False, "reason": "need_sink"}
        with self._lock:
            self._sets[(name, tid)] = (src, dst)
            self._sets.move_to_end((name, tid))
            while len(self._sets) > MAX_SETS:
                self._sets.popitem(last=False)
        return {"ok": True}

    def tables(self, name: str, tid: bytes) -> TableSet | None:
        with self._lock:
            return self._sets.get((name, tid))

    def close(self) -> None:
        """Let go of the agent and of every sink (its engine is closing)."""
        with self._lock:
            self._sinks.clear()
            self._pending.clear()
            self._loaded.clear()
            self._sets.clear()
        self._agent = None
        self._unload = _nothing


def _nothing(*_a: Any) -> None:
    return None
