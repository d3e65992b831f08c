"""Peers' host names resolved within a deadline, and connections made to them.

``socket.create_connection`` resolves a name with ``getaddrinfo``, which no socket timeout
bounds: a slow or hostile resolver (a name taken from a request's ``kv_transfer_params``,
or from a peer's reply) could hold a transfer thread for as long as it likes. Here an IP
literal needs no lookup; a name must be a host name (letters, digits, ``-`` and ``_`` in
dot-separated labels) and is looked up on a daemon thread of its own, shared by every
caller that waits for the same name, while each caller waits only until its own deadline.
At most :data:`MAX_PENDING` lookups run at once (past that a caller fails at once);
answers are kept :data:`KEEP_S` seconds, failed lookups :data:`KEEP_FAILED_S`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout

__all__ = ["KEEP_FAILED_S", "KEEP_S", "MAX_PENDING", "Resolver", "addresses", "connect"]

#: lookups running at once, over all names
MAX_PENDING = 16
#: how long an answer is used before the name is looked up again
KEEP_S = 30.0
#: how long a name that did not resolve is refused before it is looked up again
KEEP_FAILED_S = 5.0
#: names remembered at most (the oldest is forgotten past it)
MAX_KEPT = 256
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")

#: ``(family, sockaddr without its port)``: an address ``socket.connect`` takes once the
#: port is put in
Address = tuple[int, tuple[Any, ...]]


def _literal(host: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 4:
        return socket.AF_INET, (host,)
    # numeric: no lookup; gives a scoped address's (``fe80::1%eth0``) interface index
    try:
        infos = socket.getaddrinfo(
            host, None, socket.AF_INET6, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST
        )
    except (OSError, UnicodeError) as e:  # a scope naming no interface here
        raise KVTransferError(f"peer address {host[:80]!r} is not usable here: {e}") from None
    addr = infos[0][4]
    return socket.AF_INET6, (addr[0], *addr[2:])


def _check_name(host: str) -> None:
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise KVTransferError(
            f"peer host {host[:80]!r} is neither an IP address nor a host name: check the "
            "remote_host / endpoint the request or its sender names"
        )


class _Lookup:
    """One ``getaddrinfo`` of one name, on its own daemon thread."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.done = threading.Event()
        self.found: list[Address] = []
        self.error: KVTransferError | None = None

    def run(self) -> None:
        try:
            infos = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
            self.found = [(int(f), (a[0], *a[2:])) for f, _t, _p, _c, a in infos]
            if not self.found:
                raise socket.gaierror("no address")
        except (OSError, UnicodeError) as e:
            self.error = KVTransferError(
                f"peer host {self.host!r} does not resolve ({e}): check the remote_host / "
                "endpoint the request or its sender names, or use an IP address"
            )


class Resolver:
    """Host names looked up with a bound on time, on concurrent lookups and on memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[float, _Lookup]] = OrderedDict()
        self._pending: dict[str, _Lookup] = {}

    def addresses(self, host: str, deadline: float) -> list[Address]:
        """``host``'s addresses; ``KVTransferTimeout`` past ``deadline`` (``time.monotonic``),
        ``KVTransferError`` for a name that is malformed, does not resolve, or cannot be
        looked up now (:data:`MAX_PENDING` lookups running)."""
        literal = _literal(host)
        if literal is not None:
            return [literal]
        _check_name(host)
        job = self._job(host)
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            raise KVTransferTimeout(f"looking up peer host {host!r} took past the deadline")
        if job.error is not None:
            raise job.error
        return job.found

    def _job(self, host: str) -> _Lookup:
        now = time.monotonic()
        with self._lock:
            kept = self._kept.get(host)
            if kept is not None and kept[0] > now:
                return kept[1]
            job = self._pending.get(host)
            if job is not None:
                return job
            if len(self._pending) >= MAX_PENDING:
                raise KVTransferError(
                    f"{MAX_PENDING} host-name lookups are still running (a slow resolver): "
                    f"{host!r} not looked up; name peers by IP address"
                )
            job = self._pending[host] = _Lookup(host)
        threading.Thread(target=self._run, args=(job,), name="omnikv-resolve", daemon=True).start()
        return job

    def _run(self, job: _Lookup) -> None:
        try:
            job.run()
        finally:
            keep = KEEP_FAILED_S if job.error is not None else KEEP_S
            with self._lock:
                self._pending.pop(job.host, None)
                self._kept[job.host] = (time.monotonic() + keep, job)
                self._kept.move_to_end(job.host)
                while len(self._kept) > MAX_KEPT:
                    self._kept.popitem(last=False)
            job.done.set()


_RESOLVER = Resolver()


def addresses(host: str, deadline: float) -> list[Address]:
    """:meth:`Resolver.addresses` of the process's resolver."""
    return _RESOLVER.addresses(host, deadline)


def connect(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to ``host:port`` made by ``deadline`` (``time.monotonic``), the
    name looked up within it too. ``KVTransferTimeout`` when the lookup runs past it;
    ``KVTransferError`` for a bad name; the last address's ``OSError`` (``TimeoutError``
    past the deadline, ``ConnectionRefusedError`` where nothing listens) otherwise."""
    last: OSError = TimeoutError(f"no time left to connect to {host}:{port}")
    for family, addr in addresses(host, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(left)
            sock.connect((addr[0], port, *addr[1:]))
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last
