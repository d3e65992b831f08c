"""A small ZMQ request/reply side channel with msgpack messages and bounded waits.

The server is one ROUTER socket served by one background thread; the client
uses a REQ socket per (thread, endpoint) with ``RCVTIMEO``/``SNDTIMEO`` so a
dead or stuck peer surfaces as :class:`KVTransferTimeout` instead of a hang.
After a timeout the REQ socket is discarded (its state machine is stuck) and a
fresh one is made on the next call. Messages are msgpack maps only (no pickle).

With an auth key (:mod:`vllm_omni_kv.wire.auth`) on both ends, every message is
its msgpack body followed by a 32-byte keyed BLAKE2b MAC (distinct keys for
requests and replies). A request also carries ``_ts`` (the sender's wall clock)
and ``_nonce`` (16 random bytes): the server refuses a request whose MAC does
not match, whose ``_ts`` is more than :data:`MAX_SKEW_S` away from its own clock,
or whose nonce it has already seen (a replay), answering ``{"ok": False,
"reason": "unauthenticated"}`` without running the handler. Replies echo the
request's nonce under their MAC, so a client accepts only the reply to its own
request. A reply that fails this, or a refusal as unauthenticated, raises
:class:`KVPayloadError` at the client (refused, not retried: the keys differ).
"""

from __future__ import annotations

import hmac
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from vllm_omni_kv.errors import KVPayloadError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.kvcache.kv_utils import kv_zmq_port, sender_rank_port
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, MESSAGE_MAC_SIZE, AuthKey

logger = init_logger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

#: largest message either side accepts; requests/replies are tiny maps
MAX_MESSAGE = 1 << 20
#: largest request a server accepts, and how many it queues per peer: a flood of large
#: messages costs at most MAX_REQUEST * RCV_QUEUE bytes per connected peer
MAX_REQUEST = 64 << 10
RCV_QUEUE = 16
#: requests a server answers per second (a token bucket of this many, refilled continuously);
#: beyond that it replies ``busy`` without running the handler, and clients retry
MAX_RATE = 20000.0
#: ops answered even when over the rate (ending a pull must never fail for load)
EXEMPT_OPS = frozenset({"release"})
#: a keyed request whose ``_ts`` is further than this from the server's clock is refused
MAX_SKEW_S = 30.0
#: nonces a keyed server remembers (each for ``2 * MAX_SKEW_S``); beyond this it answers busy
MAX_NONCES = 1 << 18
NONCE_SIZE = 16


def pack(msg: dict[str, Any], auth: AuthKey | None = None, *, reply: bool = False) -> bytes:
    """A message's bytes: msgpack, followed by its MAC when ``auth`` is given."""
    out: bytes = msgpack.packb(msg, use_bin_type=True)
    return out if auth is None else out + auth.message_mac(out, reply=reply)


def authenticated_body(raw: bytes, auth: AuthKey, *, reply: bool = False) -> bytes | None:
    """The msgpack body of a keyed message, or None when its MAC does not match."""
    if len(raw) <= MESSAGE_MAC_SIZE:
        return None
    body, mac = raw[:-MESSAGE_MAC_SIZE], raw[-MESSAGE_MAC_SIZE:]
    return body if hmac.compare_digest(auth.message_mac(body, reply=reply), mac) else None


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
    between messages at least every ``idle_interval_s`` (used for TTL sweeps).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        ctx: zmq.Context[Any] | None = None,
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = 0.2,
        name: str = "omnikv-side-channel",
        max_rate: float = MAX_RATE,
        auth: AuthKey | None = None,
    ) -> None:
        self._handler = handler
        self._auth = auth
        self._nonces: set[bytes] = set()
        self._nonce_expiry: deque[tuple[float, bytes]] = deque()
        self._refusal_logged = -math.inf
        self._rate = float(max_rate)
        self._tokens = self._rate
        self._refilled = time.monotonic()
        self._on_idle = on_idle
        self._idle_interval = max(0.01, idle_interval_s)
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        self._sock.setsockopt(zmq.RCVHWM, RCV_QUEUE)
        self._sock.setsockopt(zmq.SNDHWM, RCV_QUEUE)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close(0)
            if self._own_ctx:
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
        poller.register(self._sock, zmq.POLLIN)
        next_idle = time.monotonic() + self._idle_interval
        poll_ms = int(min(self._idle_interval, 0.05) * 1000)  # also bounds close() latency
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(poll_ms))
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                raise
            if self._sock in events:
                self._handle_one()
            now = time.monotonic()
            if self._on_idle is not None and now >= next_idle:
                next_idle = now + self._idle_interval
                try:
                    self._on_idle()
                except Exception:
                    logger.exception("side-channel idle callback failed")
        self._sock.close(0)

    def _handle_one(self) -> None:
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) < 3:  # ROUTER: identity, empty delimiter (REQ), payload
            return
        ident, payload = frames[0], frames[-1]
        now = time.monotonic()
        self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        nonce: bytes | None = None
        try:
            if self._auth is not None:
                msg, nonce, refusal = self._open_keyed(payload, now)
                if refusal is not None:
                    self._tokens = max(0.0, self._tokens - 1)  # refusals cost the bucket
                    if now - self._refusal_logged >= 10.0:  # at most one warning per 10 s
                        self._refusal_logged = now
                        logger.warning("side channel refused a request: %s", refusal.get("error"))
                    self._reply(ident, refusal, None)
                    return
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
        self._reply(ident, reply, nonce)

    def _reply(self, ident: bytes, reply: dict[str, Any], nonce: bytes | None) -> None:
        """Send ``reply``; keyed (echoing ``nonce``) when the request was authenticated."""
        if nonce is not None and self._auth is not None:
            raw = pack({**reply, "_nonce": nonce}, self._auth, reply=True)
        else:
            raw = pack(reply)
        try:
            self._sock.send_multipart([ident, b"", raw], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the requester went away; nothing to do
            logger.debug("side-channel reply dropped: %s", e)

    def _open_keyed(
        self, payload: bytes, now: float
    ) -> tuple[dict[str, Any], bytes | None, dict[str, Any] | None]:
        """``(request, nonce, None)`` for an authenticated fresh request, else
        ``({}, None, refusal)``. Malformed bodies under a valid MAC raise KVTransferError."""
        assert self._auth is not None

        def refuse(why: str) -> tuple[dict[str, Any], None, dict[str, Any]]:
            return {}, None, {"ok": False, "reason": "unauthenticated", "error": why}

        body = authenticated_body(payload, self._auth)
        if body is None:
            return refuse(
                "request not authenticated: its MAC is missing or made with another key; "
                f"give every stage the same auth_key_file (or {ENV_KEY_FILE})"
            )
        msg = unpack(body)
        ts, nonce = msg.pop("_ts", None), msg.pop("_nonce", None)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
            return refuse("request not authenticated: it carries no valid nonce")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            return refuse("request not authenticated: it carries no valid timestamp")
        skew = ts - time.time()
        if abs(skew) > MAX_SKEW_S:
            return refuse(
                f"request refused: its timestamp is {skew:+.1f}s from this host's clock (at "
                f"most {MAX_SKEW_S:g}s allowed): a replayed request, or clocks out of sync"
            )
        while self._nonce_expiry and self._nonce_expiry[0][0] <= now:
            self._nonces.discard(self._nonce_expiry.popleft()[1])
        if nonce in self._nonces:
            return refuse("request refused: its nonce was already used (a replayed request)")
        if len(self._nonces) >= MAX_NONCES:
            return {}, None, {"ok": False, "reason": "busy"}
        self._nonces.add(nonce)
        self._nonce_expiry.append((now + 2 * MAX_SKEW_S, nonce))
        return msg, nonce, None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("side-channel thread did not stop within %.1fs", timeout)
        elif self._own_ctx:
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
        timeout_ms = max(1, int(timeout * 1000))
        sock = self._socket(endpoint, timeout_ms)
        nonce = os.urandom(NONCE_SIZE)
        if self._auth is not None:
            out = pack({**msg, "_ts": time.time(), "_nonce": nonce}, self._auth)
        else:
            out = pack(msg)
        try:
            sock.send(out)
            raw = sock.recv()
        except zmq.Again:
            self._drop(endpoint)
            raise KVTransferTimeout(
                f"no reply from {endpoint} to {msg.get('op')!r} within {timeout:.1f}s: the sender "
                "process is gone, stuck, or unreachable (check its host/zmq_port and firewall)"
            ) from None
        except zmq.ZMQError as e:
            self._drop(endpoint)
            raise KVTransferError(f"side-channel request to {endpoint} failed: {e}") from None
        if self._auth is None:
            reply = unpack(raw)
            if reply.get("reason") == "unauthenticated":
                raise KVPayloadError(
                    f"the sender at {endpoint} refused the request ({reply.get('error')}): it "
                    f"requires an auth key; set the same auth_key_file (or {ENV_KEY_FILE}) here"
                )
            return reply
        return self._keyed_reply(endpoint, raw, nonce)

    def _keyed_reply(self, endpoint: str, raw: bytes, nonce: bytes) -> dict[str, Any]:
        assert self._auth is not None
        body = authenticated_body(raw, self._auth, reply=True)
        if body is None:
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
        reply = unpack(body)
        if reply.pop("_nonce", None) != nonce:
            raise KVPayloadError(
                f"side-channel reply from {endpoint} does not answer this request (a replayed "
                "or misrouted reply)"
            )
        return reply

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
