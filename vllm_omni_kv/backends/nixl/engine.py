"""A NIXL agent behind the pull connector's :class:`EngineAdapter` interface.

One agent per connector (a unique name), over UCX by default. The pool is
registered once (``DRAM`` for a host pool, ``VRAM`` for a ``cuda`` pool); with
``register_cache`` the KV cache is registered too (``DRAM``, or ``VRAM`` of its
device through :meth:`NixlEngine.register_device`). A peer is named by its
*session* ``"<agent>@<host>:<side-channel port>"``: the first read from a session
fetches that agent's metadata over our TCP side channel (op ``nixl_md``, each try
bounded by ``handshake_timeout_s``, at most ``1 + handshake_retries`` tries) and
loads it with ``add_remote_agent``. The reply also lists the peer's registered ranges and
their memory types; a read of a range outside them fetches the metadata once more (the peer
registered memory since) before it is refused. A read is one ``READ`` transfer (several
ranges: one transfer of several descriptors) polled until done; past ``timeout_s`` it raises
:class:`~vllm_omni_kv.backends.pull.puller.ReadStillRunning`, and the transfer is polled to
its end off the pull thread (:mod:`.abandoned`). A move of pages out of a registered cache
(:meth:`NixlEngine.read_pages`) is one transfer too, made by index: each side's page tables
are prepared once as a list of strided descriptors (one per layer; at most
:mod:`.prepared_lists`; a peer's released with it), so a move's host work is two index
arrays and one post whatever its page count. A failed transfer forgets the peer so the next
read handshakes again (a restarted sender has a new agent name anyway).

``direction`` picks who posts: ``read`` (this agent READs), ``write`` (the peer WRITEs
into this agent's memory, :mod:`.write_client` / :mod:`.writer`), or ``auto`` (WRITE
where the peer's memory is ``VRAM``, whose READ UCX may serve by TCP; READ otherwise).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from vllm_omni_kv.backends.backoff import Backoff
from vllm_omni_kv.backends.keyed_locks import KeyedLocks
from vllm_omni_kv.backends.nixl.abandoned import Abandoned
from vllm_omni_kv.backends.nixl.handshake import (
    ask_metadata,
    load_peer,
    log_peer,
    parse_session,
)
from vllm_omni_kv.backends.nixl.loader import PROGRESS_WAIT_US, import_nixl, make_agent
from vllm_omni_kv.backends.nixl.memory import (
    Span,
    kind_of,
    memory_of,
    posting,
    producer_writes,
    registration_hint,
    tables_kind,
)
from vllm_omni_kv.backends.nixl.prepared_lists import LOCAL_SIDE, PreparedLists
from vllm_omni_kv.backends.nixl.write_client import WriteClient
from vllm_omni_kv.backends.nixl.writer import Writer
from vllm_omni_kv.backends.pull.page_reads import PageReads, Read
from vllm_omni_kv.backends.pull.puller import ReadStillRunning
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import AuthKey

logger = init_logger(__name__)

#: remote agents kept loaded at most (the least recently used one is removed past it)
MAX_PEERS = 256
#: the most descriptors a prepared list may hold (its indices are int32)
_MAX_INDEX = 2**31 - 1
DIRECTIONS = ("auto", "read", "write")


class _Peer:
    def __init__(self, name: str, spans: list[Span]) -> None:
        self.name, self.spans = name, spans


class NixlEngine:
    """Adapter from a NIXL agent to the pull connector's engine operations."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        backends: tuple[str, ...] = ("UCX",),
        num_threads: int = 0,
        timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        handshake_retries: int = 1,
        auth: AuthKey | None = None,
        direction: str = "auto",
        progress_wait_us: int = PROGRESS_WAIT_US,
    ) -> None:
        agent_cls, config_cls, sync_t = import_nixl()
        self.name = f"omnikv-{uuid.uuid4().hex[:16]}"
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.handshake_retries = max(0, handshake_retries)
        self.mem_type, self.device_id = memory_of(device)  # the pool's
        self.backends = list(backends)
        # several pull threads share the agent: RW mode lets transfers run side by side and
        # makes metadata changes (register, add/remove remote agents) exclusive
        conf = config_cls(
            backends=list(backends),
            num_threads=num_threads,
            sync_mode=sync_t.NIXL_THREAD_SYNC_RW,
        )
        try:
            self.agent: Any = make_agent(agent_cls, self.name, conf, progress_wait_us)
        except Exception as e:
            raise BackendUnavailable(
                f"NIXL agent with backends {list(backends)} could not start: {e}"
            ) from e
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise BackendUnavailable(
                f"NIXL has no {missing} plugin here (available: {self.agent.plugin_list}); "
                "set nixl_backends to one of those"
            )
        self.session = f"{self.name}@127.0.0.1:0"  # set by ``advertise``
        self._regs: dict[int, tuple[Any, Span]] = {}  # address -> (NIXL handle, range)
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._session_locks = KeyedLocks()  # one handshake per peer at a time
        self._prepared = PreparedLists()
        self._client = SideChannelClient(handshake_timeout_s, auth=auth)
        self._closed = False
        self._abandoned = Abandoned(self.agent.check_xfer_state)
        self.direction = direction
        self.writer = Writer(  # serves the WRITE direction's side-channel ops
            self.agent, self._prepared, self._spans, self._unload_sink
        )
        self._writes = WriteClient(
            self.agent, self.name, self._spans, self._client, handshake_timeout_s, self._is_closed
        )

    def advertise(self, host: str, port: int) -> None:
        """Name this agent's side channel in its session (after the server bound ``port``)."""
        self.session = f"{self.name}@{host}:{port}"

    def metadata(self) -> dict[str, Any]:
        """What a peer needs to read from this agent (served under :data:`MD_OP`)."""
        spans = [list(span) for span in self._spans()]
        return {"agent": self.name, "metadata": self.agent.get_agent_metadata(), "spans": spans}

    def _spans(self) -> list[Span]:
        with self._lock:
            return [span for _reg, span in self._regs.values()]

    def _is_closed(self) -> bool:
        return self._closed

    def _writes_to(self, rmem: str, peer: _Peer) -> bool:
        """Whether ``peer`` WRITEs this move (never this agent itself: a dual connector
        reads its own memory)."""
        if peer.name == self.name:
            return False
        return producer_writes(self.direction, rmem)

    def register(self, addr: int, size: int) -> None:
        """Register the pool (memory of the pool's device)."""
        self._register((addr, size, self.mem_type, self.device_id))

    def register_device(self, addr: int, size: int, device: str) -> None:
        """Register ``size`` bytes at ``addr`` on ``device`` (``cpu``: ``DRAM``, ``cuda:N``:
        ``VRAM`` of device N), e.g. a KV cache that peers read directly."""
        self._register((addr, size, *memory_of(device)))

    def _register(self, span: Span) -> None:
        addr, size, mem, dev = span
        try:
            reg = self.agent.register_memory([(addr, size, dev, "")], mem)
        except Exception as e:
            raise KVTransferError(
                f"NIXL register_memory({addr:#x}, {size}, {mem}:{dev}) failed: {e} "
                + registration_hint(mem)
            ) from None
        with self._lock:
            self._regs[addr] = (reg, span)
        self._writes.forget()  # producers learn our new metadata at the next move

    def unregister(self, addr: int) -> None:
        with self._lock:
            reg = self._regs.pop(addr, None)
        if reg is not None:
            self._prepared.drop(self.agent, LOCAL_SIDE)  # lists over this memory go first
            self._prepared.drop(self.agent, self.name)
            self.agent.deregister_memory(reg[0])
            self._writes.forget()

    # -- handshake -------------------------------------------------------------------
    def handshake(self, session: str, stale: _Peer | None = None) -> _Peer:
        """The peer of ``session``, fetching and loading its metadata on first use (and
        again when the loaded one is ``stale``: loading an agent's metadata once more
        adds the memory it registered since)."""
        parse_session(session)  # a session no handshake could use is listed nowhere
        with self._lock:
            if self._closed:
                raise KVTransferError("the NIXL engine is closed; create a new connector")
            peer = self._peers.get(session)
            if peer is not None and peer is not stale:
                self._peers.move_to_end(session)
                return peer
        with self._session_locks.held(session):  # others wait for its result
            return self._handshake_once(session, stale)

    def _handshake_once(self, session: str, stale: _Peer | None) -> _Peer:
        """Under the session's lock: the peer another thread loaded meanwhile, else fetch
        and load it (the least recently used peer past :data:`MAX_PEERS` is unloaded)."""
        with self._lock:
            peer = self._peers.get(session)
        if peer is not None and peer is not stale:
            return peer
        peer = self._fetch(session)
        with self._lock:
            self._peers[session] = peer
            evicted = self._peers.popitem(last=False) if len(self._peers) > MAX_PEERS else None
        if evicted is not None:
            self._unload(evicted[1].name)
        return peer

    def _fetch(self, session: str) -> _Peer:
        name, endpoint = parse_session(session)
        reply = ask_metadata(
            self._client, endpoint, self.handshake_timeout_s, self.handshake_retries
        )
        spans = load_peer(self.agent, self.name, name, endpoint, reply)
        log_peer(name, endpoint, spans, self._spans(), self.carriers(), self.direction)
        return _Peer(name, spans)

    def transport(self) -> str:
        """:meth:`carriers` and who posts the moves (:func:`~.memory.posting`; under
        ``auto``, by the memory of the peers handshaken so far: ``/write`` once they all
        give device memory)."""
        with self._lock:
            peers = [p.spans for p in self._peers.values() if p.name != self.name]
        return self.carriers() + posting(self.direction, {m for s in peers for *_r, m, _d in s})

    def carriers(self) -> str:
        """NIXL's backends, and the UCX transports allowed (``UCX_TLS``) when UCX is one."""
        tls = os.environ.get("UCX_TLS", "") if "UCX" in self.backends else ""
        return "+".join(self.backends) + (f"[UCX_TLS={tls}]" if tls else "")

    def forget(self, session: str) -> None:
        """Drop a peer (after a failed transfer); the next read handshakes again."""
        with self._lock:
            peer = self._peers.pop(session, None)
        if peer is not None:
            self._unload(peer.name)

    def _unload_sink(self, name: str) -> None:
        """Drop a consumer the writer loaded, unless this agent also reads from it."""
        with self._lock:
            if name == self.name or any(p.name == name for p in self._peers.values()):
                return
        self._unload(name)

    def _unload(self, name: str) -> None:
        if self._abandoned.holds(name):  # a transfer with it may still land bytes
            return
        self._prepared.drop(self.agent, name)  # lists over the memory the peer had registered
        if name == self.name or self.writer.holds(name):  # a sink's metadata stays loaded
            return
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("remove_remote_agent(%r): %s", name, e)

    # -- transfers -------------------------------------------------------------------
    def read(self, session: str, local_addr: int, remote_addr: int, length: int) -> None:
        """Copy ``length`` bytes at ``remote_addr`` of ``session``'s registered memory to
        ``local_addr``.

        Raises :class:`KVTransferError` (never its ``TimeoutError`` subclass: the pull
        connector runs reads in futures, whose waits treat ``TimeoutError`` as "not done").
        """
        self.read_many(session, [(local_addr, remote_addr, length)])

    def read_many(self, session: str, reads: list[tuple[int, int, int]]) -> None:
        """Several ``(local, remote, bytes)`` reads from ``session``: one NIXL transfer of
        as many descriptors per pair of memory types (usually one). Raises like :meth:`read`."""
        try:
            peer = self.handshake(session)
            kinds = [kind_of(peer.spans, r, n) for _l, r, n in reads]
            if None in kinds:  # the peer may have registered memory since we loaded it
                peer = self.handshake(session, stale=peer)
                kinds = [kind_of(peer.spans, r, n) for _l, r, n in reads]
            spans = self._spans()
            groups: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {}
            for (local, remote, n), kind in zip(reads, kinds, strict=True):
                mine = kind_of(spans, local, n)
                if kind is None or mine is None:
                    raise KVTransferError(
                        f"NIXL cannot read {n} bytes at {remote:#x} from {peer.name} into "
                        f"{local:#x}: the range is not in {'this agent' if kind else 'the sender'}'s "
                        "registered memory"
                    )
                groups.setdefault((mine[0], kind[0]), []).append(
                    (local, remote, n, mine[1], kind[1])
                )
            for (lmem, rmem), group in groups.items():
                if self._writes_to(rmem, peer):
                    self._written(session, peer, [(a, r, n) for a, r, n, _ld, _rd in group])
                    continue
                self._transfer(session, peer, lmem, rmem, group)
        except KVTransferTimeout as e:
            raise KVTransferError(str(e)) from None

    def read_pages(self, session: str, reads: PageReads) -> None:
        """One move's pages from ``session`` as one transfer: each side's page tables are
        a prepared list of strided descriptors (prepared once per peer and tables, kept
        while the peer is), the move is posted by index. Raises like :meth:`read`."""
        n = len(reads.remote_ids)
        if not n:
            return
        try:
            peer = self.handshake(session)
            rkind = tables_kind(peer.spans, reads.remote)
            if rkind is None:  # the peer may have registered memory since we loaded it
                peer = self.handshake(session, stale=peer)
                rkind = tables_kind(peer.spans, reads.remote)
            spans = self._spans()
            lkind = tables_kind(spans, reads.local) if spans else None
            pages = max(sum(t.count for t in reads.remote), sum(t.count for t in reads.local))
            if rkind is None or lkind is None or pages > _MAX_INDEX:  # mixed kinds, or unknown
                self.read_many(session, reads.ranges())  # names the range it cannot read
                return
            if self._writes_to(rkind[0], peer):
                self._written(session, peer, reads)
                return
            r_ids, l_ids = reads.remote_ids.astype(np.int32), reads.local_ids.astype(np.int32)
            sides = [(LOCAL_SIDE, lkind, reads.local), (peer.name, rkind, reads.remote)]
            prepped = partial(self.agent.make_prepped_xfer, "READ")  # (lists) -> a request
            make = partial(self._prepared.request, self.agent, sides,
                           lambda h: prepped(h[0], l_ids, h[1], r_ids))  # fmt: skip
            what = f"{n} pages, {lkind[0]} <- {rkind[0]}"
            self._post(session, peer, make, reads.nbytes, what)
        except KVTransferTimeout as e:
            raise KVTransferError(str(e)) from None

    def _written(self, session: str, peer: _Peer, reads: PageReads | list[Read]) -> None:
        """A move the peer WRITEs; a failed one forgets the peer (and our setup there)."""
        endpoint = parse_session(session)[1]
        try:
            if isinstance(reads, PageReads):
                self._writes.write_pages(endpoint, peer.name, reads, self.timeout_s)
            else:
                self._writes.write_ranges(endpoint, peer.name, reads, self.timeout_s)
        except BaseException:
            self.forget(session)
            self._writes.forget(endpoint)
            raise

    def _transfer(
        self,
        session: str,
        peer: _Peer,
        lmem: str,
        rmem: str,
        reads: list[tuple[int, int, int, int, int]],
    ) -> None:
        agent = self.agent

        def make() -> Any:
            local = agent.get_xfer_descs([(a, n, ld) for a, _r, n, ld, _rd in reads], lmem)
            remote = agent.get_xfer_descs([(r, n, rd) for _a, r, n, _ld, rd in reads], rmem)
            return agent.initialize_xfer("READ", local, remote, peer.name)

        total = sum(r[2] for r in reads)
        self._post(session, peer, make, total, f"{len(reads)} ranges, {lmem} <- {rmem}")

    def _post(
        self, session: str, peer: _Peer, make: Callable[[], Any], total: int, what: str
    ) -> None:
        """Make one transfer request, post it and wait for it; a failed one forgets the peer."""
        agent = self.agent
        try:
            handle = make()
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(
                f"NIXL cannot read {total} bytes ({what}) from {peer.name}: {e} (the ranges "
                "are not in the registered memory)"
            ) from None
        try:
            state = agent.transfer(handle)
            state = self._wait(agent, handle, state, time.monotonic() + self.timeout_s, peer.name)
        except BaseException:
            self.forget(session)
            raise
        if state != "DONE":
            self.forget(session)
            raise KVTransferError(
                f"NIXL read of {total} bytes from {peer.name} failed ({state}): the sender "
                "is gone or unreachable"
            )
        handle.release()

    def _wait(self, agent: Any, handle: Any, state: str, deadline: float, peer: str) -> str:
        """Poll until the transfer leaves ``PROC``. Past ``deadline`` one still running is
        handed to :class:`Abandoned` (releasing it would not stop its bytes everywhere):
        :class:`ReadStillRunning` keeps its destination until it ends."""
        backoff = Backoff()
        while state == "PROC":
            if time.monotonic() >= deadline or self._closed:
                raise ReadStillRunning(
                    f"NIXL read from {peer} did not end within {self.timeout_s:.1f}s; its "
                    "destination is kept until the transfer ends",
                    self._abandoned.add(handle, peer, f"a NIXL read from {peer}"),
                )
            backoff.sleep()
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            try:
                handle.release()
            except Exception as e:
                logger.debug("releasing a failed NIXL transfer: %s", e)
        return str(state)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), OrderedDict()
        self.writer.close()
        self._abandoned.close()
        self._prepared.close(self.agent)
        for p in peers:
            self._unload(p.name)
        for addr in list(self._regs):
            try:
                self.unregister(addr)
            except Exception as e:
                logger.debug("deregister_memory at close: %s", e)
        self._client.close()
        self._writes.close()
        self.agent = None  # the last reference: the agent and its progress thread go now
