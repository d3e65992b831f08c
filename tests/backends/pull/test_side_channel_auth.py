"""The keyed side channel: bare ZMQ clients without the key, with another key, or replaying
a captured request are refused and never reach the handler; forged replies fail the client."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from vllm_omni_kv.backends.pull.side_channel import (
    MAX_SKEW_S,
    SideChannelClient,
    SideChannelServer,
    authenticated_body,
    pack,
)
from vllm_omni_kv.errors import KVPayloadError
from vllm_omni_kv.wire.auth import AuthKey

from ..conformance import te_config, wait_until

KEY = AuthKey(b"side-channel-key-" + bytes(range(32)))
OTHER = AuthKey(b"another-channel-key-" + bytes(range(32)))


def _raw(endpoint: str, payload: bytes, timeout_ms: int = 2000) -> bytes:
    """One request from a bare REQ socket (what anyone on the network can send)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(endpoint)
        sock.send(payload)
        return bytes(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def _request(key: AuthKey, msg: dict[str, Any], ts: float | None = None) -> tuple[bytes, bytes]:
    nonce = os.urandom(16)
    body = {**msg, "_ts": time.time() if ts is None else ts, "_nonce": nonce}
    return pack(body, key), nonce


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
        assert keyed.calls == [{"op": "ping", "x": 7}]  # no _ts / _nonce
    finally:
        client.close()


def test_unauthenticated_and_wrong_key_requests_never_reach_the_handler(keyed: _Server) -> None:
    ep = keyed.server.endpoint
    msg = {"op": "acquire", "key": "k", "lease_s": 1.0}
    good_body = msgpack.packb({**msg, "_ts": time.time(), "_nonce": os.urandom(16)})
    cases = {
        "plain msgpack": msgpack.packb(msg),
        "other key": _request(OTHER, msg)[0],
        "truncated MAC": _request(KEY, msg)[0][:-1],
        "MAC of the body with the reply key": good_body + KEY.message_mac(good_body, reply=True),
        "no nonce": pack({**msg, "_ts": time.time()}, KEY),
        "no timestamp": pack({**msg, "_nonce": os.urandom(16)}, KEY),
        "empty": b"",
    }
    for name, payload in cases.items():
        reply = _plain_reply(_raw(ep, payload))
        assert reply["ok"] is False and reply["reason"] == "unauthenticated", name
    assert keyed.calls == []


def test_replayed_and_stale_requests_are_refused(keyed: _Server) -> None:
    ep = keyed.server.endpoint
    captured, nonce = _request(KEY, {"op": "ping", "x": 1})
    first = _raw(ep, captured)
    body = authenticated_body(first, KEY, reply=True)
    assert body is not None
    assert msgpack.unpackb(body) == {"ok": True, "echo": 1, "_nonce": nonce}
    replay = _plain_reply(_raw(ep, captured))
    assert replay["reason"] == "unauthenticated" and "already used" in replay["error"]
    for skew in (-(MAX_SKEW_S + 30), MAX_SKEW_S + 30):
        stale, _ = _request(KEY, {"op": "ping", "x": 2}, ts=time.time() + skew)
        reply = _plain_reply(_raw(ep, stale))
        assert reply["reason"] == "unauthenticated" and "timestamp" in reply["error"]
    assert keyed.calls == [{"op": "ping", "x": 1}]


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
    """A ROUTER that answers each request with ``make_reply(request_bytes)``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        try:
            while not stop.is_set():
                if sock.poll(50):
                    ident, _empty, payload = sock.recv_multipart()
                    sock.send_multipart([ident, b"", make_reply(payload)])
        finally:
            sock.close(0)
            ctx.term()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{port}", stop, t


def _nonce_of(payload: bytes) -> bytes:
    body = authenticated_body(payload, KEY)
    assert body is not None
    nonce = msgpack.unpackb(body)["_nonce"]
    assert isinstance(nonce, bytes)
    return nonce


@pytest.mark.parametrize(
    "forge,match",
    [
        (lambda p: pack({"ok": True}), "not authenticated"),
        (lambda p: pack({"ok": True, "_nonce": _nonce_of(p)}, OTHER, reply=True), "not auth"),
        (lambda p: pack({"ok": True, "_nonce": _nonce_of(p)}, KEY), "not authenticated"),
        (lambda p: pack({"ok": True, "_nonce": os.urandom(16)}, KEY, reply=True), "replayed"),
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
    keyed.server._rate = keyed.server._tokens = 5.0
    for _ in range(20):  # wrong key: refused, and each refusal costs a token
        _raw(endpoint, _request(OTHER, {"x": 1})[0])
    _raw(endpoint, _request(KEY, {"x": 2})[0])  # a valid request, answered busy
    assert not any(c.get("x") == 2 for c in keyed.calls), "the refusals cost nothing"


def test_a_request_over_the_size_bound_is_dropped() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda m: {"ok": True})
    try:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        with pytest.raises(zmq.Again):  # zmq drops the peer: no reply ever comes
            _raw(endpoint, pack({"op": "acquire", "pad": b"x" * (1 << 20)}), timeout_ms=500)
        assert _plain_reply(_raw(endpoint, pack({"op": "acquire"})))["ok"]
    finally:
        server.close()
