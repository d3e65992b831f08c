"""What anyone on the network can do to a side channel: bare TCP, frames of their choosing."""

from __future__ import annotations

import socket
import struct

from vllm_omni_kv.backends.pull.framing import split_endpoint


def connect(endpoint: str, timeout: float = 2.0) -> socket.socket:
    sock = socket.create_connection(split_endpoint(endpoint), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_frame(sock: socket.socket) -> bytes | None:
    """The next frame, or None when the server closed the connection first."""
    head = _read(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    return _read(sock, n)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def raw_request(endpoint: str, payload: bytes, timeout: float = 2.0) -> bytes | None:
    """One framed request on a new connection: the reply, or None when the server closed
    the connection without one. Raises ``TimeoutError`` when nothing comes in time."""
    with connect(endpoint, timeout) as sock:
        try:
            sock.sendall(struct.pack(">I", len(payload)) + payload)
        except ConnectionError:
            return None
        return read_frame(sock)
