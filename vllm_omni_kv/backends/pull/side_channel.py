"""A small request/reply side channel over TCP: msgpack maps, bounded memory and waits.

The server (:class:`SideChannelServer`) is one listening socket served by one background
thread; the client (:class:`~.channel_client.SideChannelClient`) keeps one connection per
(thread, server). Messages are length-prefixed msgpack maps (:mod:`.framing`; no pickle).

Memory: a server holds at most :data:`MAX_PEERS` connections (a new one beyond them takes
the place of the longest idle, when one has been idle :data:`EVICT_IDLE_S`, or is closed
at once), reads at most one request of at most :data:`MAX_REQUEST` bytes per connection
at a time (a longer one closes the connection before a byte of it is read) and reads the
next only once its reply went out. So what it buffers for its peers is at most
``MAX_PEERS * (MAX_REQUEST + one reply)``: 8.3 MiB with replies of 17 KiB (an
``acquire`` reply carries a block of at most 16 KiB, :data:`.exposure.INLINE_MAX`). A
connection whose request does not arrive whole, or whose reply is not taken whole, within
:data:`STALL_S` of its first byte is closed.

With an auth key (:mod:`vllm_omni_kv.wire.auth`) on both ends, every message is a
keyed envelope (:mod:`.envelope`): a header with a timestamp, a nonce, the boot id of
the server process it is for and the body's digest, a MAC over that header, then the
body. The server (:class:`~.envelope.KeyedGate`) checks the header's MAC before it
looks at the body and refuses, with ``{"ok": False, "reason": "unauthenticated"}`` and
without running the handler, a request with a wrong MAC, a timestamp more than
:data:`MAX_SKEW_S` from its clock, a nonce it has seen (a replay) or a body that is not
the one its header names. A request for another boot id (another server, or this one
before a restart) is refused with a sealed ``retarget`` reply carrying this server's
boot id; the client then resends once. Replies are sealed with the request's nonce, so
a client accepts only the reply to its own request. Refusals cost the rate bucket like
requests.
"""

from __future__ import annotations

import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.backends.pull.channel_client import UNKNOWN_BOOT, SideChannelClient
from vllm_omni_kv.backends.pull.envelope import BOOT_SIZE, Header, KeyedGate, seal
from vllm_omni_kv.backends.pull.framing import (
    LENGTH,
    MAX_MESSAGE,
    MAX_REQUEST,
    frame,
    pack,
    unpack,
)
from vllm_omni_kv.backends.rate import TokenBucket
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.kvcache.kv_utils import kv_zmq_port, sender_rank_port
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import AuthKey

__all__ = [
    "MAX_MESSAGE",
    "MAX_REQUEST",
    "PORT_KEYS",
    "UNKNOWN_BOOT",
    "SideChannelClient",
    "SideChannelServer",
    "pack",
    "sender_zmq_port",
    "unpack",
]

logger = init_logger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

#: connections a server holds at a time (each client thread keeps one per server)
MAX_PEERS = 256
#: at the cap, a new connection replaces one idle at least this long (else it is closed)
EVICT_IDLE_S = 1.0
#: a connection whose request does not arrive whole, or whose reply is not taken whole,
#: this long after it began is closed (a peer trickling bytes holds a slot no longer)
STALL_S = 10.0
#: requests a server answers per second (a token bucket of this many, refilled continuously);
#: beyond that it replies ``busy`` without running the handler, and clients retry
MAX_RATE = 20000.0
#: ops answered even when over the rate (ending a pull must never fail for load)
EXEMPT_OPS = frozenset({"release"})
#: a keyed request whose timestamp is further than this from the server's clock is refused
MAX_SKEW_S = 30.0
#: nonces a keyed server remembers (each for ``2 * MAX_SKEW_S``); beyond this it answers busy
MAX_NONCES = 1 << 18


@dataclass(eq=False)
class _Peer:
    """One connection: the request being read (length prefix, then body) or the reply
    being written; never both."""

    sock: socket.socket
    since: float  # when its current request or reply began, or it went idle
    buf: bytearray = field(default_factory=bytearray)
    need: int = LENGTH.size  # bytes still to read of the current part
    body: bool = False  # reading the body (else the length prefix)
    out: memoryview | None = None  # the reply still to write

    @property
    def idle(self) -> bool:
        return not self.buf and not self.body and self.out is None


class SideChannelServer:
    """Serve ``handler(request) -> reply`` on ``tcp://host:port`` from a daemon thread.

    ``port=0`` binds a random free port (see :attr:`port`). ``on_idle`` runs between
    requests at least every ``idle_interval_s`` (used for TTL sweeps). :attr:`boot` is
    the server's boot id, random per server; :attr:`open_peers` and :attr:`refused_peers`
    count its connections now and those closed for the cap.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = 0.2,
        name: str = "omnikv-side-channel",
        max_rate: float = MAX_RATE,
        auth: AuthKey | None = None,
        max_peers: int = MAX_PEERS,
        stall_s: float = STALL_S,
    ) -> None:
        self._handler = handler
        self._auth = auth
        self.boot = os.urandom(BOOT_SIZE)
        self._gate = None if auth is None else KeyedGate(auth, self.boot, MAX_SKEW_S, MAX_NONCES)
        self._refusal_logged = -math.inf
        self._bucket = TokenBucket(max_rate, max_rate)
        self._on_idle = on_idle
        self._idle_interval = max(0.01, idle_interval_s)
        self.max_peers, self.stall_s = max_peers, stall_s
        self.refused_peers = 0
        self._peers: dict[socket.socket, _Peer] = {}
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as e:
            raise KVTransferError(
                f"cannot bind the side channel on tcp://{host}:{port}: {e}. Another process "
                "(or another TP rank) already uses this port: give each sender its own "
                "zmq_port / local_rank, or set zmq_port=0 for a random port"
            ) from None
        self._listener.setblocking(False)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def open_peers(self) -> int:
        return len(self._peers)

    # -- the serving thread --------------------------------------------------------------
    def _serve(self) -> None:
        next_idle = next_sweep = time.monotonic() + self._idle_interval
        wait = min(self._idle_interval, 0.05)  # also bounds close() latency
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(wait):
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    peer: _Peer = key.data
                    if self._peers.get(peer.sock) is peer:  # not closed earlier in this batch
                        self._flush(peer) if mask & selectors.EVENT_WRITE else self._read(peer)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + min(1.0, self.stall_s / 4)
                    self._drop_stalled(now)
                if self._on_idle is not None and now >= next_idle:
                    next_idle = now + self._idle_interval
                    try:
                        self._on_idle()
                    except Exception:
                        logger.exception("side-channel idle callback failed")
        finally:
            for peer in list(self._peers.values()):
                self._close(peer)
            self._sel.close()
            self._listener.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: leave it in the backlog a while
                logger.warning("side channel cannot accept a connection: %s", e)
                time.sleep(0.01)
                return
            now = time.monotonic()
            if len(self._peers) >= self.max_peers and not self._evict_idle(now):
                self.refused_peers += 1
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = self._peers[sock] = _Peer(sock, now)
            self._sel.register(sock, selectors.EVENT_READ, peer)

    def _evict_idle(self, now: float) -> bool:
        """Close the connection idle the longest, when one was idle ``EVICT_IDLE_S``."""
        idle = [p for p in self._peers.values() if p.idle and now - p.since >= EVICT_IDLE_S]
        if not idle:
            return False
        self._close(min(idle, key=lambda p: p.since))
        return True

    def _drop_stalled(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if not peer.idle and now - peer.since > self.stall_s:
                logger.debug("side channel closed a connection stalled for %.0fs", self.stall_s)
                self._close(peer)

    def _close(self, peer: _Peer) -> None:
        self._peers.pop(peer.sock, None)
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()

    def _read(self, peer: _Peer) -> None:
        """Read what the current part still needs (never past it); answer a whole request."""
        try:
            data = peer.sock.recv(peer.need)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(peer)
            return
        if peer.idle:  # a request begins: it must arrive whole within stall_s
            peer.since = time.monotonic()
        peer.buf += data
        peer.need -= len(data)
        if peer.need:
            return
        if not peer.body:
            (n,) = LENGTH.unpack(peer.buf)
            if n > MAX_REQUEST:  # never read: the connection goes
                logger.debug("side channel dropped a %d-byte request (at most %d)", n, MAX_REQUEST)
                self._close(peer)
                return
            peer.body, peer.need, peer.buf = True, n, bytearray()
            if n:
                return
        payload = bytes(peer.buf)
        peer.buf, peer.body, peer.need = bytearray(), False, LENGTH.size
        self._write(peer, memoryview(frame(self._answer(payload))))

    def _write(self, peer: _Peer, out: memoryview) -> None:
        """Send what the socket takes now; wait for writability (reading nothing) for the rest."""
        try:
            sent = peer.sock.send(out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(peer)
            return
        rest = out[sent:]
        if peer.out is None or not rest.nbytes:  # a reply begins, or ends (idle from now)
            peer.since = time.monotonic()
        if rest.nbytes:
            if peer.out is None:
                self._sel.modify(peer.sock, selectors.EVENT_WRITE, peer)
            peer.out = rest
        elif peer.out is not None:
            peer.out = None
            self._sel.modify(peer.sock, selectors.EVENT_READ, peer)

    def _flush(self, peer: _Peer) -> None:
        if peer.out is not None:
            self._write(peer, peer.out)

    # -- one request ---------------------------------------------------------------------
    def _answer(self, payload: bytes) -> bytes:
        """The reply to one request (sealed when the request was)."""
        now = time.monotonic()
        header: Header | None = None
        try:
            if self._gate is not None:
                body, header, refusal = self._gate.open(payload, now)
                if body is None:
                    self._refused(refusal, now)
                    return self._sealed(refusal, header)
                msg = unpack(body)
            else:
                msg = unpack(payload)
            op = msg.get("op")
            exempt = type(op) is str and op in EXEMPT_OPS  # answered always, free of charge
            if exempt or self._bucket.take():
                reply = self._handler(msg)
            else:
                reply = {"ok": False, "reason": "busy"}
        except KVTransferError as e:  # a malformed request: answer it, no traceback
            logger.debug("side-channel request refused: %s", e)
            reply = {"ok": False, "reason": "error", "error": str(e)}
        except Exception as e:
            logger.exception("side-channel handler failed")
            reply = {"ok": False, "reason": "error", "error": f"{type(e).__name__}: {e}"}
        return self._sealed(reply, header)

    def _refused(self, refusal: dict[str, Any], now: float) -> None:
        """A request the gate refused: it costs the bucket; warn at most every 10 s."""
        self._bucket.charge()
        if refusal.get("reason") == "unauthenticated" and now - self._refusal_logged >= 10.0:
            self._refusal_logged = now
            logger.warning("side channel refused a request: %s", refusal.get("error"))

    def _sealed(self, reply: dict[str, Any], header: Header | None) -> bytes:
        """``reply``'s bytes; sealed (with the request's nonce) when ``header`` is given."""
        if header is not None and self._auth is not None:
            return seal(reply, self._auth, nonce=header.nonce, boot=self.boot, reply=True)
        return pack(reply)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("side-channel thread did not stop within %.1fs", timeout)


#: the settings :func:`sender_zmq_port` reads
PORT_KEYS: frozenset[str] = frozenset(
    {"zmq_port", "from_stage", "stage_id", "local_rank", "replica_id"}
)


def sender_zmq_port(config: dict[str, Any]) -> int:
    """This sender's side-channel port; 0 binds a free one (advertised in put metadata).

    Without ``from_stage`` (or ``stage_id``): ``sender_rank_port(zmq_port, local_rank)``
    when ``zmq_port`` is set, else 0, so that servers sharing a host never collide (the
    vLLM connector advertises the bound port in ``kv_transfer_params``). With a stage
    (vllm-omni's scheme, where receivers derive the port), ``kv_zmq_port(zmq_port, stage,
    local_rank, replica_id)`` from ``zmq_port`` (default 50051) spreads stages, ranks and
    replicas over distinct ports. ``zmq_port=0`` always picks a free port.
    """
    raw_stage = config.get("from_stage", config.get("stage_id"))
    stage = -1 if raw_stage is None else int(raw_stage)
    raw = config.get("zmq_port")
    base = int(raw) if raw is not None else (50051 if stage >= 0 else 0)
    if base == 0:
        return 0
    if stage < 0:
        return sender_rank_port(base, int(config.get("local_rank", 0)))

    replica = config.get("replica_id")
    return kv_zmq_port(
        base,
        stage,
        int(config.get("local_rank", 0)),
        None if replica is None else int(replica),
    )
