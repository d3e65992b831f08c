"""The keyed side channel: bare TCP clients without the key, with another key, or replaying
a captured request are refused and never reach the handler; forged replies fail the client;
the header's MAC is checked before the body is hashed."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch

from vllm_omni_kv.backends.pull.envelope import OVERHEAD, body_of, open_header, seal
from vllm_omni_kv.backends.pull.side_channel import (
    MAX_REQUEST,
    MAX_SKEW_S,
    UNKNOWN_BOOT,
    SideChannelClient,
    SideChannelServer,
    pack,
)
from vllm_omni_kv.backends.rate import TokenBucket
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire.auth import AuthKey

from ..conformance import te_config, wait_until
from .raw_peer import connect, raw_request, read_frame

KEY = AuthKey(b"side-channel-key-" + bytes(range(32)))
OTHER = AuthKey(b"another-channel-key-" + bytes(range(32)))


def _raw(endpoint: str, payload: bytes) -> bytes:
    """One request from a bare TCP socket (what anyone on the network can send)."""
    reply = raw_request(endpoint, payload)
    assert reply is not None, "the server closed the connection without a reply"
    return reply


def _request(
    key: AuthKey, msg: dict[str, Any], boot: bytes, ts: float | None = None
) -> tuple[bytes, bytes]:
    """A keyed request for the server process ``boot``, and its nonce."""
    nonce = os.urandom(16)
    return seal(msg, key, nonce=nonce, boot=boot, ts=ts), nonce


def _sealed_reply(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """The nonce and body of a reply sealed with KEY (fails the test when it is not)."""
    header = open_header(raw, KEY, reply=True)
    assert header is not None
    body = body_of(raw, header)
    assert body is not None
    out = msgpack.unpackb(body)
    assert isinstance(out, dict)
    return header.nonce, out


def _plain_reply(raw: bytes) -> dict[str, Any]:
    out = msgpack.unpackb(raw, raw=False)
    assert isinstance(out, dict)
    return out


class _Server:
    def __init__(self, auth: AuthKey | None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.server = SideChannelServer("127.0.0.1", 0, self._handle, auth=auth)

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(msg)
        return {"ok": True, "echo": msg.get("x")}


@pytest.fixture
def keyed() -> Iterator[_Server]:
    s = _Server(KEY)
    yield s
    s.server.close()


def test_keyed_round_trip_and_envelope_hidden_from_handler(keyed: _Server) -> None:
    client = SideChannelClient(2.0, auth=KEY)
    try:
        assert client.request(keyed.server.endpoint, {"op": "ping", "x": 7}) == {
            "ok": True,
            "echo": 7,
        }
        assert keyed.calls == [{"op": "ping", "x": 7}]  # the envelope stays outside
    finally:
        client.close()


def test_unauthenticated_and_wrong_key_requests_never_reach_the_handler(keyed: _Server) -> None:
    ep, boot = keyed.server.endpoint, keyed.server.boot
    msg = {"op": "acquire", "key": "k", "lease_s": 1.0}
    good, _ = _request(KEY, msg, boot)
    other_body = msgpack.packb({"op": "release", "lease": "0" * 32})
    cases = {
        "plain msgpack": msgpack.packb(msg),
        "other key": _request(OTHER, msg, boot)[0],
        "truncated header": good[: OVERHEAD - 1],
        "header sealed with the reply key": seal(
            msg, KEY, nonce=os.urandom(16), boot=boot, reply=True
        ),
        "another body under a valid header": good[:OVERHEAD] + other_body,
        "body cut short": good[:-1],
        "NaN timestamp": _request(KEY, msg, boot, ts=float("nan"))[0],
        "empty": b"",
    }
    for name, payload in cases.items():
        reply = _plain_reply(_raw(ep, payload))
        assert reply["ok"] is False and reply["reason"] == "unauthenticated", name
    assert keyed.calls == []


def test_replayed_and_stale_requests_are_refused(keyed: _Server) -> None:
    ep, boot = keyed.server.endpoint, keyed.server.boot
    captured, nonce = _request(KEY, {"op": "ping", "x": 1}, boot)
    assert _sealed_reply(_raw(ep, captured)) == (nonce, {"ok": True, "echo": 1})
    replay = _plain_reply(_raw(ep, captured))
    assert replay["reason"] == "unauthenticated" and "already used" in replay["error"]
    for skew in (-(MAX_SKEW_S + 30), MAX_SKEW_S + 30):
        stale, _ = _request(KEY, {"op": "ping", "x": 2}, boot, ts=time.time() + skew)
        reply = _plain_reply(_raw(ep, stale))
        assert reply["reason"] == "unauthenticated" and "timestamp" in reply["error"]
    assert keyed.calls == [{"op": "ping", "x": 1}]


def test_a_request_for_another_boot_is_refused_with_this_servers_boot(keyed: _Server) -> None:
    ep = keyed.server.endpoint
    for boot in (UNKNOWN_BOOT, os.urandom(16)):
        req, nonce = _request(KEY, {"op": "ping", "x": 3}, boot)
        raw = _raw(ep, req)
        header = open_header(raw, KEY, reply=True)
        assert header is not None and header.nonce == nonce
        assert header.boot == keyed.server.boot
        assert _sealed_reply(raw)[1] == {"ok": False, "reason": "retarget"}
    assert keyed.calls == []


def test_the_mac_is_checked_on_the_header_before_the_body_is_hashed() -> None:
    """Refusing a message made without the key costs a hash of its 78-byte header: the
    same for a 64 MiB body as for an empty one (a hash of the body takes ~100 ms)."""
    big = _request(OTHER, {"pad": b"x" * (64 << 20)}, UNKNOWN_BOOT)[0]
    small = _request(OTHER, {}, UNKNOWN_BOOT)[0]

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    assert open_header(big, KEY) is None and open_header(small, KEY) is None
    t_big, t_small = best(lambda: open_header(big, KEY)), best(lambda: open_header(small, KEY))
    authentic = open_header(big, OTHER)
    assert authentic is not None
    t_hash = best(lambda: body_of(big, authentic))  # what the header check spares
    assert t_hash > 0.01, t_hash
    assert t_big < max(20 * t_small, 0.002) and t_big < t_hash / 10, (t_big, t_small, t_hash)


def test_clients_with_another_key_or_none_are_refused(keyed: _Server) -> None:
    other, bare = SideChannelClient(2.0, auth=OTHER), SideChannelClient(2.0)
    try:
        with pytest.raises(KVPayloadError, match="refused the request"):
            other.request(keyed.server.endpoint, {"op": "ping"})
        with pytest.raises(KVPayloadError, match="requires an auth key"):
            bare.request(keyed.server.endpoint, {"op": "ping"})
    finally:
        other.close()
        bare.close()
    assert keyed.calls == []


def test_keyed_client_refuses_an_unkeyed_server() -> None:
    plain = _Server(None)
    client = SideChannelClient(2.0, auth=KEY)
    try:
        with pytest.raises(KVPayloadError, match="not authenticated"):
            client.request(plain.server.endpoint, {"op": "ping"})
    finally:
        client.close()
        plain.server.close()


def _forging_server(make_reply: Any) -> tuple[str, threading.Event, threading.Thread]:
    """A server that answers each request with ``make_reply(request_bytes)``."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(5)
                    while (payload := read_frame(conn)) is not None:
                        reply = make_reply(payload)
                        conn.sendall(struct.pack(">I", len(reply)) + reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{listener.getsockname()[1]}", stop, t


def _nonce_of(payload: bytes) -> bytes:
    header = open_header(payload, KEY)
    assert header is not None
    return header.nonce


def _forged(key: AuthKey, nonce: bytes, *, reply: bool = True) -> bytes:
    return seal({"ok": True}, key, nonce=nonce, boot=UNKNOWN_BOOT, reply=reply)


@pytest.mark.parametrize(
    "forge,match",
    [
        (lambda p: pack({"ok": True}), "not authenticated"),
        (lambda p: _forged(OTHER, _nonce_of(p)), "not auth"),
        (lambda p: _forged(KEY, _nonce_of(p), reply=False), "not authenticated"),
        (lambda p: _forged(KEY, os.urandom(16)), "replayed"),
    ],
    ids=["unkeyed", "other-key", "request-mac", "other-nonce"],
)
def test_forged_replies_are_errors(forge: Any, match: str) -> None:
    endpoint, stop, t = _forging_server(forge)
    client = SideChannelClient(2.0, auth=KEY)
    try:
        with pytest.raises(KVPayloadError, match=match):
            client.request(endpoint, {"op": "acquire", "key": "k"})
    finally:
        client.close()
        stop.set()
        t.join(5)


# -- the Mooncake Transfer Engine backend with keys ---------------------------------------------


def _te(role: str, auth: AuthKey | None) -> Any:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    cfg = te_config(role, pool_mib=8, buffer_ttl_s=2.0)
    if auth is not None:
        cfg["auth_key"] = auth
    return MooncakeTransferEngineConnector(cfg)


@pytest.mark.mooncake
def test_mooncake_te_pulls_only_with_the_same_key() -> None:
    sender = _te("sender", KEY)
    good, wrong, bare = _te("receiver", KEY), _te("receiver", OTHER), _te("receiver", None)
    try:
        t = torch.arange(1 << 14, dtype=torch.int32)
        _ok, _size, meta = sender.put("0", "1", "k", t)
        md = {"source_host": meta["source_host"], "source_port": meta["source_port"]}
        with pytest.raises(KVPayloadError, match="not authenticated"):
            wrong.get("0", "1", "k", md)
        with pytest.raises(KVPayloadError, match="requires an auth key"):
            bare.get("0", "1", "k", md)
        got = good.get("0", "1", "k", md)  # the refused receivers took nothing
        assert got is not None
        with got[0] as buf:
            assert torch.equal(buf.to_tensor(), torch.arange(1 << 14, dtype=torch.int32))
        assert wait_until(lambda: sender.pool.allocator.used == 0, 3)
        for r in (good, wrong, bare):
            assert r.pool.allocator.used == 0
    finally:
        for c in (good, wrong, bare, sender):
            c.close()


def test_a_flood_of_releases_does_not_lock_acquires_out() -> None:
    calls: list[str] = []

    def handle(msg: dict[str, Any]) -> dict[str, Any]:
        calls.append(str(msg.get("op")))
        return {"ok": True}

    server = SideChannelServer("127.0.0.1", 0, handle, max_rate=5.0)
    try:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        for _ in range(50):  # releases are answered always and cost nothing
            assert _plain_reply(_raw(endpoint, pack({"op": "release"})))["ok"]
        assert _plain_reply(_raw(endpoint, pack({"op": "acquire"})))["ok"], "locked out"
        for _ in range(10):  # acquires do drain it: the bucket still limits them
            _raw(endpoint, pack({"op": "acquire"}))
        assert _plain_reply(_raw(endpoint, pack({"op": "acquire"})))["reason"] == "busy"
    finally:
        server.close()


def test_refused_requests_are_charged_to_the_bucket(keyed: _Server) -> None:
    endpoint = f"tcp://127.0.0.1:{keyed.server.port}"
    keyed.server._bucket = TokenBucket(5.0, 5.0)
    for _ in range(20):  # wrong key: refused, and each refusal costs a token
        _raw(endpoint, _request(OTHER, {"x": 1}, keyed.server.boot)[0])
    _raw(endpoint, _request(KEY, {"x": 2}, keyed.server.boot)[0])  # answered busy
    assert not any(c.get("x") == 2 for c in keyed.calls), "the refusals cost nothing"


def test_a_request_over_the_size_bound_is_dropped_unread() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True})
    try:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        big = pack({"op": "acquire", "pad": b"x" * MAX_REQUEST})
        assert raw_request(endpoint, big) is None  # the connection goes, no reply
        with connect(endpoint) as sock:  # only the length prefix is ever read
            sock.sendall(struct.pack(">I", 1 << 30))
            assert read_frame(sock) is None
        assert _plain_reply(_raw(endpoint, pack({"op": "acquire"})))["ok"]
    finally:
        server.close()


def test_a_stalled_request_loses_its_connection() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True}, stall_s=0.5)
    try:
        with connect(server.endpoint, timeout=5.0) as sock:
            sock.sendall(struct.pack(">I", 100) + b"\x80")  # 1 of 100 bytes, then nothing
            t0 = time.monotonic()
            assert read_frame(sock) is None
            assert 0.4 <= time.monotonic() - t0 < 3.0
        assert server.open_peers == 0
    finally:
        server.close()


def test_a_request_trickled_a_byte_at_a_time_loses_its_connection() -> None:
    """A request must arrive whole within ``stall_s`` of its first byte: a peer sending
    one byte every 0.1 s (never stalled for long) holds its slot no longer than that."""
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True}, stall_s=0.5)
    try:
        with connect(server.endpoint, timeout=5.0) as sock:
            sock.sendall(struct.pack(">I", 100))
            t0 = time.monotonic()
            closed = None
            for _ in range(50):
                try:
                    sock.sendall(b"\x80")
                except OSError:
                    closed = time.monotonic() - t0
                    break
                time.sleep(0.1)
            if closed is None:
                assert read_frame(sock) is None
                closed = time.monotonic() - t0
            assert 0.4 <= closed < 2.5, closed
        assert wait_until(lambda: server.open_peers == 0, 5)
    finally:
        server.close()


def test_beyond_the_peer_cap_a_new_connection_replaces_an_idle_one_or_is_closed() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True}, max_peers=4)
    socks = [connect(server.endpoint) for _ in range(4)]
    try:
        assert wait_until(lambda: server.open_peers == 4, 5)
        for s in socks:  # busy peers: each in the middle of a request
            s.sendall(struct.pack(">I", 100))
        assert raw_request(server.endpoint, pack({"op": "ping"})) is None  # closed at once
        assert server.refused_peers >= 1 and server.open_peers == 4
        for s in socks:  # the requests end; the peers go idle
            s.sendall(pack({"pad": b"x" * 93}))
            assert read_frame(s) is not None
        time.sleep(1.1)  # idle long enough to be evicted
        assert _plain_reply(_raw(server.endpoint, pack({"op": "ping"})))["ok"]
        assert server.open_peers <= 4
    finally:
        for s in socks:
            s.close()
        server.close()
