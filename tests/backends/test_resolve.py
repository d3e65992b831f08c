"""Peer host names are looked up within the caller's deadline (:mod:`.resolve`).

A slow or hostile resolver cannot be made real on a loopback-only machine, so it is
``socket.getaddrinfo`` replaced by one that stalls until the test lets it go; every
connection is made for real to a server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_omni_kv.backends import resolve
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient, SideChannelServer
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout

REAL = socket.getaddrinfo


class StalledDNS:
    """``getaddrinfo`` for names ending in ``.stall.test``: blocks until :meth:`answer`
    (then resolves them to 127.0.0.1); ``.none.test`` names do not exist; other names
    and literals go to the real resolver. Counts the lookups of test names."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls: list[str] = []

    def __call__(self, host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(host, str) and host.endswith(".test"):
            self.calls.append(host)
            if host.endswith(".none.test"):
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            self.go.wait(30)
            return REAL("127.0.0.1", port, *args, **kw)
        return REAL(host, port, *args, **kw)

    def answer(self) -> None:
        self.go.set()


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[StalledDNS]:
    fake = StalledDNS()
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    yield fake
    fake.answer()  # no lookup thread stays blocked past the test


def _name(kind: str = "stall") -> str:
    return f"peer-{uuid.uuid4().hex[:8]}.{kind}.test"


def test_a_stalled_lookup_ends_at_the_callers_deadline(dns: StalledDNS) -> None:
    host, r = _name(), resolve.Resolver()
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="looking up"):
        r.addresses(host, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5  # not the resolver's 30 s
    with pytest.raises(KVTransferTimeout):  # a second caller waits for the same lookup
        r.addresses(host, time.monotonic() + 0.1)
    assert dns.calls == [host]
    dns.answer()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the running lookup ends and its answer is kept
        try:
            found = r.addresses(host, time.monotonic() + 0.5)
            break
        except KVTransferTimeout:
            continue
    assert [a[1][0] for a in found] == ["127.0.0.1"]
    assert r.addresses(host, time.monotonic()) == found  # kept: no new lookup, no wait
    assert dns.calls == [host]


def test_lookups_running_at_once_are_bounded(dns: StalledDNS) -> None:
    r = resolve.Resolver()
    for _ in range(resolve.MAX_PENDING):
        with pytest.raises(KVTransferTimeout):
            r.addresses(_name(), time.monotonic() + 0.01)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="lookups are still running"):
        r.addresses(_name(), time.monotonic() + 5)
    assert time.monotonic() - t0 < 1  # refused at once, not after its deadline
    assert r.addresses("127.0.0.1", time.monotonic())  # literals need no lookup
    assert len(dns.calls) == resolve.MAX_PENDING


@pytest.mark.parametrize(
    "host",
    ["a b", "-peer", "peer-", "x..y", "évil.example", "a" * 64, ".".join(["a"] * 128), "", "h/x"],
)
def test_malformed_names_are_refused_without_a_lookup(dns: StalledDNS, host: str) -> None:
    with pytest.raises(KVTransferError, match="neither an IP address nor a host name"):
        resolve.Resolver().addresses(host, time.monotonic() + 5)
    assert dns.calls == []


def test_a_name_that_does_not_resolve_is_refused_for_a_while(dns: StalledDNS) -> None:
    host, r = _name("none"), resolve.Resolver()
    for _ in range(3):
        with pytest.raises(KVTransferError, match="does not resolve"):
            r.addresses(host, time.monotonic() + 5)
    assert dns.calls == [host]  # one lookup: its failure is kept for KEEP_FAILED_S


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_connect_reaches_a_real_listener(host: str) -> None:
    v6 = host == "::1"
    try:
        srv = socket.create_server((host, 0), family=socket.AF_INET6 if v6 else socket.AF_INET)
    except OSError as e:  # IPv6 may be off on this host
        pytest.skip(f"cannot listen on {host}: {e}")
    with srv:
        port = srv.getsockname()[1]
        with resolve.connect(host, port, time.monotonic() + 5) as sock:
            assert sock.getpeername()[1] == port


def test_connect_where_nothing_listens_is_refused() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    srv.close()
    with pytest.raises(ConnectionRefusedError):
        resolve.connect("127.0.0.1", port, time.monotonic() + 5)


def test_the_side_channel_waits_no_longer_than_its_timeout(dns: StalledDNS) -> None:
    """A request to a peer named by a stalled name ends at its timeout; once the name
    resolves, the same client reaches the real server behind it."""
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "echo": msg.get("x")})
    client = SideChannelClient()
    try:
        endpoint = f"tcp://{_name()}:{server.port}"
        t0 = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            client.request(endpoint, {"op": "ping", "x": 1}, timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        dns.answer()
        assert client.request(endpoint, {"op": "ping", "x": 2}, timeout_s=10)["echo"] == 2
        with pytest.raises(KVTransferError, match="does not resolve"):
            client.request(f"tcp://{_name('none')}:{server.port}", {"op": "ping"}, timeout_s=5)
    finally:
        client.close()
        server.close()


def test_a_scoped_ipv6_literal_keeps_its_interface(dns: StalledDNS) -> None:
    r = resolve.Resolver()
    ((family, addr),) = r.addresses("fe80::1%lo", time.monotonic() + 1)
    assert family == socket.AF_INET6 and addr[-1] == socket.if_nametoindex("lo")
    with pytest.raises(KVTransferError, match="not usable here"):
        r.addresses("fe80::1%no-such-interface", time.monotonic() + 1)
    assert dns.calls == []
