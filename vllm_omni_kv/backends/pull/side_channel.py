"""A small ZMQ request/reply side channel with msgpack messages and bounded waits.

The server is one ROUTER socket served by one background thread; the client
uses a REQ socket per (thread, endpoint) with ``RCVTIMEO``/``SNDTIMEO`` so a
dead or stuck peer surfaces as :class:`KVTransferTimeout` instead of a hang.
After a timeout the REQ socket is discarded (its state machine is stuck) and a
fresh one is made on the next call. Messages are msgpack maps only (no pickle).

Memory: a server admits at most :data:`MAX_PEERS` connections at a time
(:mod:`.peer_cap`; a connection beyond them is closed by ZeroMQ before it carries a
message), queues at most :data:`RCV_QUEUE` requests per connection and drops a
connection that sends a request over :data:`MAX_REQUEST` bytes: queued requests take at
most ``MAX_PEERS * (RCV_QUEUE + 1) * MAX_REQUEST`` bytes (12 MiB) in all.

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
a client accepts only the reply to its own request. A reply that fails this, or a
refusal as unauthenticated, raises :class:`KVPayloadError` at the client (refused, not
retried: the keys differ). Refusals cost the rate bucket like requests.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from vllm_omni_kv.backends.pull.envelope import (
    BOOT_SIZE,
    NONCE_SIZE,
    Header,
    KeyedGate,
    body_of,
    open_header,
    seal,
)
from vllm_omni_kv.backends.pull.peer_cap import PeerCap
from vllm_omni_kv.errors import KVPayloadError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.kvcache.kv_utils import kv_zmq_port, sender_rank_port
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, AuthKey

logger = init_logger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

#: largest reply a client accepts
MAX_MESSAGE = 1 << 20
#: largest request a server accepts (requests are maps of a few hundred bytes); ZeroMQ
#: drops the connection of a peer that sends more
MAX_REQUEST = 16 << 10
#: requests a server queues per connection (a REQ client has one in flight)
RCV_QUEUE = 2
#: requests handled per wake-up of the server thread before it polls again
BATCH = 16
#: replies a server queues per connection: it learns what a peer read only when it polls,
#: and a quick REQ client may get a reply per request of a batch, so BATCH + 2 never
#: drops one of its replies (a peer that reads none loses those beyond)
SND_QUEUE = BATCH + 2
#: connections a server admits at a time (each client thread holds one per server)
MAX_PEERS = 256
#: a connection that has not finished ZeroMQ's handshake in this long is dropped
HANDSHAKE_MS = 10_000
#: requests a server answers per second (a token bucket of this many, refilled continuously);
#: beyond that it replies ``busy`` without running the handler, and clients retry
MAX_RATE = 20000.0
#: ops answered even when over the rate (ending a pull must never fail for load)
EXEMPT_OPS = frozenset({"release"})
#: a keyed request whose timestamp is further than this from the server's clock is refused
MAX_SKEW_S = 30.0
#: nonces a keyed server remembers (each for ``2 * MAX_SKEW_S``); beyond this it answers busy
MAX_NONCES = 1 << 18
#: the boot id a client sends before it learnt the server's (always answered ``retarget``)
UNKNOWN_BOOT = bytes(BOOT_SIZE)


def pack(msg: dict[str, Any]) -> bytes:
    """An unkeyed message's bytes (msgpack)."""
    out: bytes = msgpack.packb(msg, use_bin_type=True)
    return out


def unpack(raw: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:
        raise KVTransferError(f"side-channel message is not valid msgpack: {e}") from None
    if not isinstance(msg, dict):
        raise KVTransferError(f"side-channel message must be a map, got {type(msg).__name__}")
    return msg


class SideChannelServer:
    """Serve ``handler(request) -> reply`` on ``tcp://host:port`` from a daemon thread.

    ``port=0`` binds a random free port (see :attr:`port`). ``on_idle`` runs
    between messages at least every ``idle_interval_s`` (used for TTL sweeps). The
    server owns its ZMQ context (its peer cap answers the context's one ZAP endpoint);
    :attr:`boot` is its boot id, random per server.
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
    ) -> None:
        self._handler = handler
        self._auth = auth
        self.boot = os.urandom(BOOT_SIZE)
        self._gate = None if auth is None else KeyedGate(auth, self.boot, MAX_SKEW_S, MAX_NONCES)
        self._refusal_logged = -math.inf
        self._rate = float(max_rate)
        self._tokens = self._rate
        self._refilled = time.monotonic()
        self._on_idle = on_idle
        self._idle_interval = max(0.01, idle_interval_s)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        for opt, value in (
            (zmq.LINGER, 0),
            (zmq.MAXMSGSIZE, MAX_REQUEST),
            (zmq.RCVHWM, RCV_QUEUE),
            (zmq.SNDHWM, SND_QUEUE),
            (zmq.HANDSHAKE_IVL, HANDSHAKE_MS),
        ):
            self._sock.setsockopt(opt, value)
        self.peers = PeerCap(self._ctx, self._sock, max_peers)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self.peers.close()
            self._sock.close(0)
            self._ctx.term()
            raise KVTransferError(
                f"cannot bind the side channel on tcp://{host}:{port}: {e}. Another process "
                "(or another TP rank) already uses this port: give each sender its own "
                "zmq_port / local_rank, or set zmq_port=0 for a random port"
            ) from None
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in (self._sock, *self.peers.sockets):
            poller.register(s, zmq.POLLIN)
        next_idle = time.monotonic() + self._idle_interval
        poll_ms = int(min(self._idle_interval, 0.05) * 1000)  # also bounds close() latency
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(poll_ms))
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                raise
            self.peers.service()
            if self._sock in events:
                for _ in range(BATCH):
                    if not self._handle_one():
                        break
            now = time.monotonic()
            if self._on_idle is not None and now >= next_idle:
                next_idle = now + self._idle_interval
                try:
                    self._on_idle()
                except Exception:
                    logger.exception("side-channel idle callback failed")
        self.peers.close()
        self._sock.close(0)

    def _handle_one(self) -> bool:
        """Answer one queued request; False when none is queued."""
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(frames) < 3:  # ROUTER: identity, empty delimiter (REQ), payload
            return True
        ident, payload = frames[0], frames[-1]
        now = time.monotonic()
        self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        header: Header | None = None
        try:
            if self._gate is not None:
                body, header, refusal = self._gate.open(payload, now)
                if body is None:
                    self._refused(refusal, now)
                    self._reply(ident, refusal, header)
                    return True
                msg = unpack(body)
            else:
                msg = unpack(payload)
            exempt = msg.get("op") in EXEMPT_OPS  # answered always, never drains the bucket
            if self._tokens < 1 and not exempt:
                reply = {"ok": False, "reason": "busy"}
            else:
                self._tokens -= 0 if exempt else 1
                reply = self._handler(msg)
        except KVTransferError as e:  # a malformed request: answer it, no traceback
            logger.debug("side-channel request refused: %s", e)
            reply = {"ok": False, "reason": "error", "error": str(e)}
        except Exception as e:
            logger.exception("side-channel handler failed")
            reply = {"ok": False, "reason": "error", "error": f"{type(e).__name__}: {e}"}
        self._reply(ident, reply, header)
        return True

    def _refused(self, refusal: dict[str, Any], now: float) -> None:
        """A request the gate refused: it costs the bucket; warn at most every 10 s."""
        self._tokens = max(0.0, self._tokens - 1)
        if refusal.get("reason") == "unauthenticated" and now - self._refusal_logged >= 10.0:
            self._refusal_logged = now
            logger.warning("side channel refused a request: %s", refusal.get("error"))

    def _reply(self, ident: bytes, reply: dict[str, Any], header: Header | None) -> None:
        """Send ``reply``; sealed (with the request's nonce) when ``header`` is given."""
        if header is not None and self._auth is not None:
            raw = seal(reply, self._auth, nonce=header.nonce, boot=self.boot, reply=True)
        else:
            raw = pack(reply)
        try:
            self._sock.send_multipart([ident, b"", raw], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the requester went away; nothing to do
            logger.debug("side-channel reply dropped: %s", e)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("side-channel thread did not stop within %.1fs", timeout)
        else:
            self._ctx.term()


class SideChannelClient:
    """Thread-safe request/reply client with a per-request deadline (keyed with ``auth``)."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        ctx: zmq.Context[Any] | None = None,
        auth: AuthKey | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._auth = auth
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._local = threading.local()
        self._all: list[zmq.Socket[Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._boots: dict[str, bytes] = {}  # endpoint -> its server's boot id (keyed)

    def _socket(self, endpoint: str, timeout_ms: int) -> zmq.Socket[Any]:
        cache: dict[str, zmq.Socket[Any]] = self._local.__dict__.setdefault("socks", {})
        sock = cache.get(endpoint)
        if sock is None:
            with self._lock:
                if self._closed:
                    raise KVTransferError("side-channel client is closed")
                sock = self._ctx.socket(zmq.REQ)
                self._all.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            sock.connect(endpoint)
            cache[endpoint] = sock
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        return sock

    def _drop(self, endpoint: str) -> None:
        cache: dict[str, zmq.Socket[Any]] = self._local.__dict__.setdefault("socks", {})
        sock = cache.pop(endpoint, None)
        if sock is not None:
            with self._lock:
                if sock in self._all:
                    self._all.remove(sock)
            sock.close(0)

    def request(
        self, endpoint: str, msg: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send ``msg`` and wait for the reply; raise ``KVTransferTimeout`` past the deadline."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._auth is None:
            reply = unpack(self._exchange(endpoint, pack(msg), timeout, msg))
            if reply.get("reason") == "unauthenticated":
                raise KVPayloadError(
                    f"the sender at {endpoint} refused the request ({reply.get('error')}): it "
                    f"requires an auth key; set the same auth_key_file (or {ENV_KEY_FILE}) here"
                )
            return reply
        deadline = time.monotonic() + timeout
        for _ in range(2):  # a server this client does not know yet first says ``retarget``
            nonce = os.urandom(NONCE_SIZE)
            boot = self._boots.get(endpoint, UNKNOWN_BOOT)
            out = seal(msg, self._auth, nonce=nonce, boot=boot)
            left = max(0.001, deadline - time.monotonic())
            header, reply = self._keyed_reply(endpoint, self._exchange(endpoint, out, left, msg))
            if header.nonce != nonce:
                raise KVPayloadError(
                    f"side-channel reply from {endpoint} does not answer this request (a "
                    "replayed or misrouted reply)"
                )
            if reply.get("reason") != "retarget":
                return reply
            self._boots[endpoint] = header.boot  # the server's boot id: resend for it
        raise KVPayloadError(
            f"the sender at {endpoint} refused this request twice as meant for another server "
            "process (retarget): its replies do not agree on its boot id"
        )

    def _exchange(self, endpoint: str, out: bytes, timeout: float, msg: dict[str, Any]) -> bytes:
        """One request/reply on this thread's socket to ``endpoint``."""
        sock = self._socket(endpoint, max(1, int(timeout * 1000)))
        try:
            sock.send(out)
            return bytes(sock.recv())
        except zmq.Again:
            self._drop(endpoint)
            raise KVTransferTimeout(
                f"no reply from {endpoint} to {msg.get('op')!r} within {timeout:.1f}s: the sender "
                "process is gone, stuck, or unreachable (check its host/zmq_port and firewall)"
            ) from None
        except zmq.ZMQError as e:
            self._drop(endpoint)
            raise KVTransferError(f"side-channel request to {endpoint} failed: {e}") from None

    def _keyed_reply(self, endpoint: str, raw: bytes) -> tuple[Header, dict[str, Any]]:
        assert self._auth is not None
        header = open_header(raw, self._auth, reply=True)
        body = None if header is None else body_of(raw, header)
        if header is None or body is None:
            try:
                plain = unpack(raw)
            except KVTransferError:
                plain = {}
            why = (
                f": it refused the request ({plain.get('error')})"
                if plain.get("reason") == "unauthenticated"
                else ""
            )
            raise KVPayloadError(
                f"side-channel reply from {endpoint} is not authenticated{why}; the sender "
                f"has no auth key or another one: give every stage the same auth_key_file "
                f"(or {ENV_KEY_FILE})"
            )
        return header, unpack(body)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks, self._all = self._all, []
        for s in socks:
            s.close(0)
        if self._own_ctx:
            self._ctx.term()


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
