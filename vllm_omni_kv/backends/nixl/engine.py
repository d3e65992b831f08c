"""A NIXL agent behind the pull connector's :class:`EngineAdapter` interface.

One agent per connector (a unique name), over UCX by default. The pool is
registered once (``DRAM`` for a host pool, ``VRAM`` for a ``cuda`` pool); with
``register_cache`` the KV cache is registered too (``DRAM``, or ``VRAM`` of its
device through :meth:`NixlEngine.register_device`). A peer is named by its
*session* ``"<agent>@<host>:<side-channel port>"``: the first read from a session
fetches that agent's metadata over our TCP side channel (op ``nixl_md``, each try
bounded by ``handshake_timeout_s``, at most ``1 + handshake_retries`` tries) and
loads it with ``add_remote_agent``. The reply also lists the peer's registered
ranges and their memory types; a read of a range outside them fetches the
metadata once more (the peer registered memory since) before it is refused. A
read is one ``READ`` transfer (several ranges: one transfer of several
descriptors) polled until done; past ``timeout_s`` it is aborted and raises
:class:`KVTransferTimeout`. A move of pages out of a registered cache
(:meth:`NixlEngine.read_pages`) is one transfer too, made by index: each side's
page tables are prepared once as a list of strided descriptors (one per layer; at most
:data:`MAX_DLISTS` lists kept, a peer's released with it), so a move's host work is
two index arrays and one post whatever its page count. A failed transfer forgets the peer so the next read
handshakes again (a restarted sender has a new agent name anyway).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_omni_kv.backends.pull.page_reads import PageReads, PageTable
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import AuthKey

logger = init_logger(__name__)

INSTALL_HINT = "pip install 'vllm-omni-kv[nixl]' (or: pip install nixl)"
#: the side-channel op that returns this agent's metadata
MD_OP = "nixl_md"
#: remote agents kept loaded at most (the least recently used one is removed past it)
MAX_PEERS = 256
#: the longest sleep between two polls of a running transfer (seconds)
MAX_POLL_S = 0.001
#: prepared descriptor lists kept at most (the least recently used one is released past it)
MAX_DLISTS = 64
#: ``prep_xfer_dlist``'s agent name for this agent's own memory (the local side)
LOCAL_SIDE = "NIXL_INIT_AGENT"
#: the most descriptors a prepared list may hold (its indices are int32)
_MAX_INDEX = 2**31 - 1


def skip_unused_rdma_modules() -> bool:
    """On a host without RDMA devices, keep UCX from loading its InfiniBand modules.

    NIXL's wheel bundles its own libibverbs / libnl; with the system's rdma-core also
    installed (Mooncake needs ``libibverbs1``) both copies of ``libnl-route`` get loaded
    and the process segfaults in their destructors at exit. The modules serve nothing
    without a device, so unless ``UCX_MODULES`` is set, ``^ib,rdmacm`` is set for this
    process (before its first agent starts). True when it was set here.
    """
    if os.environ.get("UCX_MODULES") or os.path.isdir("/sys/class/infiniband"):
        return False
    os.environ["UCX_MODULES"] = "^ib,rdmacm"
    return True


def import_nixl() -> tuple[Any, Any, Any]:
    """``(nixl_agent, nixl_agent_config, nixl_thread_sync_t)``, or ``BackendUnavailable``.

    NIXL logs each agent's start at INFO on stdout; unless ``NIXL_LOG_LEVEL`` says
    otherwise, only its warnings are shown (stdout may carry JSON, e.g. ``doctor --json``).
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        try:  # the CUDA-12 build installed without the ``nixl`` meta package
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise BackendUnavailable(
                f"NIXL is not importable ({e}); install it with: {INSTALL_HINT}"
            ) from e
    skip_unused_rdma_modules()
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def parse_session(session: str) -> tuple[str, str]:
    """``(agent name, side-channel endpoint)`` of a session ``agent@host:port``."""
    name, sep, hostport = session.rpartition("@")
    if not sep or not name or ":" not in hostport:
        raise KVTransferError(
            f"not a NIXL session: {session!r} (expected 'agent@host:port'); the sender "
            "is not a nixl backend, or its put metadata was altered"
        )
    return name, f"tcp://{hostport}"


#: a registered range: ``(address, bytes, memory type, device id)``
Span = tuple[int, int, str, int]


def memory_of(device: str) -> tuple[str, int]:
    """NIXL's ``(memory type, device id)`` of a torch device string (``cpu``, ``cuda:N``)."""
    dev = device.split(":")
    return ("VRAM" if dev[0] == "cuda" else "DRAM"), (int(dev[1]) if len(dev) > 1 and dev[1] else 0)


def _kind(spans: list[Span], addr: int, n: int) -> tuple[str, int] | None:
    """The memory type and device of the registered range holding ``[addr, addr+n)``."""
    for base, size, mem, dev in spans:
        if base <= addr and addr + n <= base + size:
            return mem, dev
    return None


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
    try:
        return host in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


def _tables_kind(spans: list[Span], tables: tuple[PageTable, ...]) -> tuple[str, int] | None:
    """The one memory type and device holding every table (None: not all registered, or
    in memory of several kinds)."""
    kinds = {_kind(spans, *t.extent) for t in tables}
    return kinds.pop() if len(kinds) == 1 else None


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
            self.agent: Any = agent_cls(self.name, conf)
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
        self._session_locks: dict[str, threading.Lock] = {}
        #: prepared descriptor lists: (agent, memory kind, page tables) -> handle
        self._dlists: OrderedDict[tuple[str, tuple[str, int], tuple[PageTable, ...]], Any] = (
            OrderedDict()
        )
        self._client = SideChannelClient(handshake_timeout_s, auth=auth)
        self._closed = False

    def advertise(self, host: str, port: int) -> None:
        """Name this agent's side channel in its session (after the server bound ``port``)."""
        self.session = f"{self.name}@{host}:{port}"

    def metadata(self) -> dict[str, Any]:
        """What a peer needs to read from this agent (served under :data:`MD_OP`)."""
        with self._lock:
            spans = [list(span) for _reg, span in self._regs.values()]
        return {"agent": self.name, "metadata": self.agent.get_agent_metadata(), "spans": spans}

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
                f"NIXL register_memory({addr:#x}, {size}, {mem}) failed: {e} "
                "(memlock limits? try a smaller memory_pool_size)"
            ) from None
        with self._lock:
            self._regs[addr] = (reg, span)

    def unregister(self, addr: int) -> None:
        with self._lock:
            reg = self._regs.pop(addr, None)
        if reg is not None:
            self._drop_dlists(LOCAL_SIDE)  # lists prepared over this agent's memory go first
            self._drop_dlists(self.name)
            self.agent.deregister_memory(reg[0])

    # -- handshake -------------------------------------------------------------------
    def handshake(self, session: str, stale: _Peer | None = None) -> _Peer:
        """The peer of ``session``, fetching and loading its metadata on first use (and
        again when the loaded one is ``stale``: loading an agent's metadata once more
        adds the memory it registered since)."""
        with self._lock:
            if self._closed:
                raise KVTransferError("the NIXL engine is closed; create a new connector")
            peer = self._peers.get(session)
            if peer is not None and peer is not stale:
                self._peers.move_to_end(session)
                return peer
            slock = self._session_locks.setdefault(session, threading.Lock())
        with slock:  # one handshake per peer at a time; others wait for its result
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
        tries = 1 + self.handshake_retries
        reply: dict[str, Any] | None = None
        for i in range(tries):
            try:
                reply = self._client.request(endpoint, {"op": MD_OP}, self.handshake_timeout_s)
                break
            except KVTransferTimeout as e:
                logger.warning("NIXL handshake with %s, try %d/%d: %s", endpoint, i + 1, tries, e)
        if reply is None:
            raise KVTransferTimeout(
                f"NIXL handshake with {endpoint} got no answer in {tries} tries of "
                f"{self.handshake_timeout_s:.1f}s: the sender is gone or unreachable "
                "(check its host / zmq_port and firewall)"
            )
        if not reply.get("ok") or reply.get("agent") != name:
            raise KVTransferError(
                f"the side channel at {endpoint} does not serve NIXL agent {name!r} "
                f"(reply: {reply.get('error') or reply.get('agent')!r}): the sender restarted "
                "or is not a nixl backend; ask it for fresh metadata"
            )
        if name != self.name:  # a dual connector reads from itself through loopback
            try:
                loaded = self.agent.add_remote_agent(bytes(reply["metadata"]))
                if isinstance(loaded, bytes):
                    loaded = loaded.decode()
            except Exception as e:
                raise KVTransferError(f"NIXL could not load {name!r}'s metadata: {e}") from None
            if loaded != name:
                raise KVTransferError(
                    f"NIXL metadata from {endpoint} names {loaded!r}, not {name!r}"
                )
        try:
            spans = [(int(a), int(n), str(m), int(d)) for a, n, m, d in reply.get("spans") or []]
        except (TypeError, ValueError):
            raise KVTransferError(f"NIXL metadata from {endpoint}: bad memory ranges") from None
        self._record(name, endpoint, spans)
        return _Peer(name, spans)

    def transport(self) -> str:
        """NIXL's backends, and the UCX transports allowed (``UCX_TLS``) when UCX is one."""
        tls = os.environ.get("UCX_TLS", "") if "UCX" in self.backends else ""
        return "+".join(self.backends) + (f"[UCX_TLS={tls}]" if tls else "")

    def _record(self, name: str, endpoint: str, spans: list[Span]) -> None:
        """Log what a new peer's reads cross: its memory, ours, the transports allowed; warn
        where device memory would be READ on one host (UCX serves that by TCP)."""
        with self._lock:
            ours = sorted({f"{m}:{d}" for _r, (_a, _n, m, d) in self._regs.values()})
        theirs = sorted({f"{m}:{d}" for _a, _n, m, d in spans})
        logger.info(
            "NIXL peer %s at %s: its memory %s, this agent's %s, over %s",
            name,
            endpoint,
            theirs or "none",
            ours or "none",
            self.transport(),
        )
        warning = device_read_warning(theirs, endpoint)
        if warning:
            logger.warning("NIXL peer %s at %s: %s", name, endpoint, warning)

    def forget(self, session: str) -> None:
        """Drop a peer (after a failed transfer); the next read handshakes again."""
        with self._lock:
            peer = self._peers.pop(session, None)
            slock = self._session_locks.get(session)
            if slock is not None and not slock.locked():
                del self._session_locks[session]
        if peer is not None:
            self._unload(peer.name)

    def _unload(self, name: str) -> None:
        self._drop_dlists(name)  # prepared over the memory the peer had registered
        if name == self.name:
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
            kinds = [_kind(peer.spans, r, n) for _l, r, n in reads]
            if None in kinds:  # the peer may have registered memory since we loaded it
                peer = self.handshake(session, stale=peer)
                kinds = [_kind(peer.spans, r, n) for _l, r, n in reads]
            with self._lock:
                spans = [span for _reg, span in self._regs.values()]
            groups: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {}
            for (local, remote, n), kind in zip(reads, kinds, strict=True):
                if kind is None:
                    raise KVTransferError(
                        f"NIXL cannot read {n} bytes at {remote:#x} from {peer.name}: the range "
                        "is not in the sender's registered memory"
                    )
                lmem, ldev = _kind(spans, local, n) or (self.mem_type, self.device_id)
                groups.setdefault((lmem, kind[0]), []).append((local, remote, n, ldev, kind[1]))
            for (lmem, rmem), group in groups.items():
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
            rkind = _tables_kind(peer.spans, reads.remote)
            if rkind is None:  # the peer may have registered memory since we loaded it
                peer = self.handshake(session, stale=peer)
                rkind = _tables_kind(peer.spans, reads.remote)
            with self._lock:
                spans = [span for _reg, span in self._regs.values()]
            lkind = _tables_kind(spans, reads.local) if spans else None
            pages = max(sum(t.count for t in reads.remote), sum(t.count for t in reads.local))
            if rkind is None or lkind is None or pages > _MAX_INDEX:  # mixed kinds, or unknown
                self.read_many(session, reads.ranges())  # names the range it cannot read
                return
            remote = self._dlist(peer.name, rkind, reads.remote)
            local = self._dlist(LOCAL_SIDE, lkind, reads.local)
            r_ids = reads.remote_ids.astype(np.int32)
            l_ids = reads.local_ids.astype(np.int32)

            def make() -> Any:
                with self._lock:  # no prepared list is released while a request is made
                    return self.agent.make_prepped_xfer("READ", local, l_ids, remote, r_ids)

            what = f"{n} pages, {lkind[0]} <- {rkind[0]}"
            self._post(session, peer, make, reads.nbytes, what)
        except KVTransferTimeout as e:
            raise KVTransferError(str(e)) from None

    def _dlist(self, agent: str, kind: tuple[str, int], tables: tuple[PageTable, ...]) -> Any:
        """The prepared descriptor list of ``tables`` (one strided descriptor per table)
        on ``agent``'s side (:data:`LOCAL_SIDE`: this agent's memory)."""
        key = (agent, kind, tables)
        with self._lock:
            if key in self._dlists:
                self._dlists.move_to_end(key)
                return self._dlists[key]
        rows = np.array([t.row(kind[1]) for t in tables], dtype=np.uint64)
        try:
            handle = self.agent.prep_xfer_dlist(agent, rows, kind[0])
        except Exception as e:
            raise KVTransferError(
                f"NIXL could not prepare {len(tables)} page tables of {kind[0]} memory on "
                f"{agent!r}: {e}"
            ) from None
        with self._lock:
            if key in self._dlists:  # another thread prepared it meanwhile
                drop: list[Any] = [handle]
                handle = self._dlists[key]
            else:
                self._dlists[key] = handle
                drop = []
                while len(self._dlists) > MAX_DLISTS:
                    drop.append(self._dlists.popitem(last=False)[1])
            for h in drop:
                self._release_dlist(h)
        return handle

    def _drop_dlists(self, agent: str) -> None:
        """Release the prepared lists of ``agent``'s memory."""
        with self._lock:
            for key in [k for k in self._dlists if k[0] == agent]:
                self._release_dlist(self._dlists.pop(key))

    def _release_dlist(self, handle: Any) -> None:
        try:
            self.agent.release_dlist_handle(handle)
        except Exception as e:
            logger.debug("releasing a prepared NIXL descriptor list: %s", e)

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
        """Poll until the transfer leaves ``PROC``; abort it past ``deadline``.

        A transfer that cannot be aborted is waited out: its destination must stay
        valid until it ends (the caller has already been told of the timeout).
        """
        delay = 0.0
        while state == "PROC":
            if time.monotonic() >= deadline:
                try:
                    handle.release()  # NIXL aborts a running transfer when released
                except Exception as e:
                    logger.debug("NIXL could not abort a read from %s yet: %s", peer, e)
                else:
                    raise KVTransferTimeout(
                        f"NIXL read from {peer} made no progress within {self.timeout_s:.1f}s; "
                        "aborted"
                    )
                if self._closed:
                    return "ERR"
                deadline = time.monotonic() + 0.1
            time.sleep(delay)
            delay = min(MAX_POLL_S, delay + 0.00005)
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
            dlists, self._dlists = list(self._dlists.values()), OrderedDict()
        for h in dlists:
            self._release_dlist(h)
        for p in peers:
            self._unload(p.name)
        for addr in list(self._regs):
            try:
                self.unregister(addr)
            except Exception as e:
                logger.debug("deregister_memory at close: %s", e)
        self._client.close()
        self.agent = None
