"""At most ``limit`` connected peers on a ZMQ socket, enforced by ZeroMQ itself.

The socket gets a ZAP domain, so ZeroMQ asks a ZAP handler (ZeroMQ's authentication
protocol, on ``inproc://zeromq.zap.01`` of the socket's context) to admit every new
connection before it carries a message; a socket monitor reports each accepted and each
closed connection. :meth:`PeerCap.service` (run by the thread that owns the socket)
counts the open connections and refuses a new one while ``limit`` are open: ZeroMQ then
closes it, no message of it is queued. A refused ZeroMQ client reconnects on its own and
is admitted once a slot is free.

The context must be the socket's own: a context has one ZAP endpoint.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["ZAP_ENDPOINT", "PeerCap"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class PeerCap:
    """Admit at most ``limit`` connections to ``sock`` (set up before ``sock`` binds)."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], limit: int) -> None:
        self.limit = limit
        self.refused = 0  # connections refused for the cap
        self._open: set[int] = set()  # file descriptors of accepted, not yet closed peers
        self._zap = ctx.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"omnikv-side-channel")
        addr = f"inproc://omnikv-peers-{id(self):x}"
        sock.monitor(addr, _EVENTS)
        self._mon = ctx.socket(zmq.PAIR)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.setsockopt(zmq.RCVHWM, 0)  # no event is dropped: the count stays exact
        self._mon.connect(addr)
        self._sock = sock

    @property
    def sockets(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """The sockets to poll for :meth:`service`."""
        return self._zap, self._mon

    @property
    def open_peers(self) -> int:
        return len(self._open)

    def service(self, most: int = 64) -> None:
        """Count the connections opened and closed, then answer up to ``most`` pending
        admissions (a storm of connections does not starve the socket's messages)."""
        self._drain_events()
        for _ in range(most):
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._drain_events()  # this connection's own ACCEPTED came before its request
            self._answer(frames)

    def _drain_events(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.discard(int(event["value"]))

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER view of a ZAP request: routing id, delimiter, version, request id, ...
        if len(frames) < 4:
            return
        ok = len(self._open) <= self.limit  # the open set counts the peer asking
        if not ok:
            self.refused += 1
        status = (b"200", b"OK") if ok else (b"400", b"too many side-channel peers")
        self._zap.send_multipart([frames[0], b"", b"1.0", frames[3], *status, b"", b""])

    def close(self) -> None:
        """Stop monitoring (before ``sock`` closes) and close the cap's own sockets."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(0)
        self._zap.close(0)
