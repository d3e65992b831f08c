"""The side channel's client: one TCP connection per (thread, server), every request
bounded by a deadline.

Endpoints come from requests' parameters and from peers' replies, so what the client keeps
per endpoint is bounded: a thread keeps at most :data:`MAX_SOCKETS` connections (the least
recently used one is closed past it, and a thread's connections are closed once the thread
is gone), and the client remembers at most :data:`MAX_BOOTS` servers' boot ids. A request
that ends in anything but a clean reply (a timeout, a reply that is not msgpack or not
sealed, a misrouted one) closes its connection: the next request makes a new one.

A request connects (retrying a refused connection until the deadline: a server may be
starting), sends its frame and reads the reply frame; past the deadline it raises
:class:`KVTransferTimeout` and drops the connection (the next request makes a new one).
A kept connection the server closed meanwhile (a restart, or it evicted an idle peer)
fails before any reply byte: the request is sent once more on a new connection.

With an auth key, a request is a keyed envelope (:mod:`.envelope`) for the server's boot
id; a server this client does not know yet (or one that restarted) answers a sealed
``retarget`` with its boot id, and the request is sent once more for it. A reply must be
sealed with the request's nonce; anything else raises :class:`KVPayloadError`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

from vllm_omni_kv.backends.pull.envelope import (
    BOOT_SIZE,
    NONCE_SIZE,
    Header,
    body_of,
    open_header,
    seal,
)
from vllm_omni_kv.backends.pull.framing import (
    LENGTH,
    MAX_MESSAGE,
    frame,
    pack,
    split_endpoint,
    unpack,
)
from vllm_omni_kv.backends.resolve import connect
from vllm_omni_kv.errors import KVPayloadError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, AuthKey

__all__ = ["MAX_BOOTS", "MAX_SOCKETS", "UNKNOWN_BOOT", "SideChannelClient"]

#: the boot id a client sends before it learnt the server's (always answered ``retarget``)
UNKNOWN_BOOT = bytes(BOOT_SIZE)
#: pause between two connection attempts to a server that is not listening (yet)
CONNECT_RETRY_S = 0.05
#: connections one thread keeps open (the least recently used one is closed past it)
MAX_SOCKETS = 64
#: servers whose boot id a client remembers (the least recently used one is forgotten)
MAX_BOOTS = 256


#: the request (for messages) and its timeout
_What = tuple[dict[str, Any], float]


class _Gone(Exception):
    """The connection closed before any byte of the reply came."""


class _Sockets:
    """One thread's connections by endpoint, least recently used first; they are closed
    once the thread (and with it this object) is gone."""

    def __init__(self, every: set[socket.socket], lock: threading.Lock) -> None:
        self.by_endpoint: OrderedDict[str, socket.socket] = OrderedDict()
        weakref.finalize(self, _close_all, self.by_endpoint, every, lock)


def _close_all(
    socks: OrderedDict[str, socket.socket], every: set[socket.socket], lock: threading.Lock
) -> None:
    with lock:
        every.difference_update(socks.values())
    for sock in socks.values():
        sock.close()
    socks.clear()


def _timeout(endpoint: str, what: _What) -> KVTransferTimeout:
    msg, timeout = what
    return KVTransferTimeout(
        f"no reply from {endpoint} to {msg.get('op')!r} within {timeout:.1f}s: the sender "
        "process is gone, stuck, or unreachable (check its host/zmq_port and firewall)"
    )


class SideChannelClient:
    """Thread-safe request/reply client with a per-request deadline (keyed with ``auth``);
    each thread keeps at most ``max_sockets`` connections."""

    def __init__(
        self, timeout_s: float = 5.0, auth: AuthKey | None = None, max_sockets: int = MAX_SOCKETS
    ) -> None:
        self.timeout_s = timeout_s
        self._auth = auth
        self.max_sockets = max(1, max_sockets)  # per thread
        self._local = threading.local()
        self._all: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        #: endpoint -> its server's boot id (keyed), least recently used first
        self._boots: OrderedDict[str, bytes] = OrderedDict()

    @property
    def open_sockets(self) -> int:
        """Connections open now, in all threads."""
        with self._lock:
            return len(self._all)

    def request(
        self, endpoint: str, msg: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send ``msg`` and wait for the reply; raise ``KVTransferTimeout`` past the deadline."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        what = (msg, timeout)
        deadline = time.monotonic() + timeout
        try:
            if self._auth is None:
                return self._plain(endpoint, msg, deadline, what)
            return self._keyed(endpoint, self._auth, deadline, what)
        except BaseException:
            self._drop(endpoint)  # anything but a clean reply: the connection is not reused
            raise

    def _plain(
        self, endpoint: str, msg: dict[str, Any], deadline: float, what: _What
    ) -> dict[str, Any]:
        reply = unpack(self._exchange(endpoint, pack(msg), deadline, what))
        if reply.get("reason") == "unauthenticated":
            raise KVPayloadError(
                f"the sender at {endpoint} refused the request ({reply.get('error')}): it "
                f"requires an auth key; set the same auth_key_file (or {ENV_KEY_FILE}) here"
            )
        return reply

    def _keyed(self, endpoint: str, auth: AuthKey, deadline: float, what: _What) -> dict[str, Any]:
        msg = what[0]
        for _ in range(2):  # a server this client does not know yet first says ``retarget``
            nonce = os.urandom(NONCE_SIZE)
            out = seal(msg, auth, nonce=nonce, boot=self._boot(endpoint))
            raw = self._exchange(endpoint, out, deadline, what)
            header, reply = self._keyed_reply(endpoint, raw)
            if header.nonce != nonce:
                raise KVPayloadError(
                    f"side-channel reply from {endpoint} does not answer this request (a "
                    "replayed or misrouted reply)"
                )
            if reply.get("reason") != "retarget":
                return reply
            self._learn_boot(endpoint, header.boot)  # the server's boot id: resend for it
        raise KVPayloadError(
            f"the sender at {endpoint} refused this request twice as meant for another server "
            "process (retarget): its replies do not agree on its boot id"
        )

    def _boot(self, endpoint: str) -> bytes:
        """The boot id of ``endpoint``'s server, or :data:`UNKNOWN_BOOT`."""
        with self._lock:
            boot = self._boots.get(endpoint)
            if boot is None:
                return UNKNOWN_BOOT
            self._boots.move_to_end(endpoint)
            return boot

    def _learn_boot(self, endpoint: str, boot: bytes) -> None:
        with self._lock:
            self._boots[endpoint] = boot
            self._boots.move_to_end(endpoint)
            while len(self._boots) > MAX_BOOTS:
                self._boots.popitem(last=False)

    def _exchange(self, endpoint: str, payload: bytes, deadline: float, what: _What) -> bytes:
        """One request/reply on this thread's connection to ``endpoint``."""
        for attempt in range(2):
            sock, kept = self._socket(endpoint, deadline, what)
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    sock.sendall(frame(payload))
                except ConnectionError as e:
                    raise _Gone(str(e)) from None
                return self._read_reply(sock, deadline)
            except _Gone as e:
                self._drop(endpoint)
                if kept and attempt == 0:
                    continue  # the server closed this kept connection: one new one
                raise KVTransferError(f"side-channel request to {endpoint} failed: {e}") from None
            except TimeoutError:
                self._drop(endpoint)
                raise _timeout(endpoint, what) from None
            except OSError as e:
                self._drop(endpoint)
                raise KVTransferError(f"side-channel request to {endpoint} failed: {e}") from None
        raise AssertionError("unreachable")

    def _read_reply(self, sock: socket.socket, deadline: float) -> bytes:
        head = self._read(sock, LENGTH.size, deadline, first=True)
        (n,) = LENGTH.unpack(head)
        if n > MAX_MESSAGE:
            raise OSError(f"the reply announces {n} bytes, over the {MAX_MESSAGE}-byte limit")
        return self._read(sock, n, deadline, first=False)

    @staticmethod
    def _read(sock: socket.socket, n: int, deadline: float, *, first: bool) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                k = sock.recv_into(view[got:])
            except ConnectionError as e:
                if first and got == 0:
                    raise _Gone(str(e)) from None
                raise
            if k == 0:
                if first and got == 0:
                    raise _Gone("the server closed the connection")
                raise OSError("the server closed the connection mid-reply")
            got += k
        return bytes(buf)

    def _sockets(self) -> OrderedDict[str, socket.socket]:
        """This thread's connections, least recently used first."""
        mine: _Sockets | None = getattr(self._local, "socks", None)
        if mine is None:
            mine = self._local.socks = _Sockets(self._all, self._lock)
        return mine.by_endpoint

    def _socket(self, endpoint: str, deadline: float, what: _What) -> tuple[socket.socket, bool]:
        """This thread's connection to ``endpoint`` and whether it was kept from before."""
        cache = self._sockets()
        sock = cache.get(endpoint)
        if sock is not None:
            cache.move_to_end(endpoint)
            return sock, True
        host, port = split_endpoint(endpoint)
        while True:
            with self._lock:
                if self._closed:
                    raise KVTransferError("side-channel client is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout(endpoint, what)
            try:
                sock = connect(host, port, deadline)  # the name looked up within it too
                break
            except (TimeoutError, KVTransferTimeout):
                raise _timeout(endpoint, what) from None
            except OSError:  # not listening (yet): retry until the deadline
                time.sleep(min(CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.add(sock)
        if closed:  # closed while this connected
            sock.close()
            raise KVTransferError("side-channel client is closed")
        cache[endpoint] = sock
        while len(cache) > self.max_sockets:  # the least recently used one goes
            self._close(cache.popitem(last=False)[1])
        return sock, False

    def _drop(self, endpoint: str) -> None:
        sock = self._sockets().pop(endpoint, None)
        if sock is not None:
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._all.discard(sock)
        sock.close()

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
            socks = list(self._all)
            self._all.clear()  # (the set threads' finalizers hold)
        for s in socks:
            s.close()
