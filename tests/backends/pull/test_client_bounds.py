"""What a side-channel client keeps per endpoint is bounded: connections per thread (the
least recently used one closed), boot ids and holder ids (least recently used forgotten),
and a request that ends in anything but a clean reply closes its connection. Every
server is real, on 127.0.0.1."""

from __future__ import annotations

import gc
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_omni_kv.backends.pull import channel_client, sender_requests
from vllm_omni_kv.backends.pull.channel_client import MAX_SOCKETS
from vllm_omni_kv.backends.pull.sender_requests import MAX_HOLDER_CHARS, SenderRequests
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient, SideChannelServer
from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.wire.auth import AuthKey

from ..conformance import wait_until

KEY = AuthKey(b"client-bounds-key-" + bytes(range(32)))


def _echo(msg: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "echo": msg.get("x")}


@pytest.fixture
def servers() -> Iterator[list[SideChannelServer]]:
    out = [SideChannelServer("127.0.0.1", 0, _echo) for _ in range(5)]
    yield out
    for s in out:
        s.close()


def _sockets_open() -> int:
    """This process's open TCP sockets (both ends of every loopback connection)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def test_a_thread_keeps_at_most_max_sockets_connections(
    servers: list[SideChannelServer],
) -> None:
    assert SideChannelClient().max_sockets == MAX_SOCKETS == 64
    base = _sockets_open()
    client = SideChannelClient(timeout_s=2.0, max_sockets=3)
    try:
        for rnd in range(2):  # the second round reconnects to every evicted server
            for i, s in enumerate(servers):
                assert client.request(s.endpoint, {"op": "x", "x": i + rnd})["echo"] == i + rnd
                assert client.open_sockets <= 3
        assert wait_until(lambda: sum(s.open_peers for s in servers) <= 3, 5.0)
        assert wait_until(lambda: _sockets_open() - base <= 2 * 3, 5.0), _sockets_open() - base
        # a kept connection is reused: the most recent three stay, nothing new opens
        accepted = [s.open_peers for s in servers]
        for s in servers[2:]:
            assert client.request(s.endpoint, {"op": "x"})["ok"]
        assert [s.open_peers for s in servers] == accepted
    finally:
        client.close()
    assert client.open_sockets == 0
    assert wait_until(lambda: sum(s.open_peers for s in servers) == 0, 5.0)


def test_a_gone_threads_connections_are_closed(servers: list[SideChannelServer]) -> None:
    client = SideChannelClient(timeout_s=2.0)
    try:

        def run() -> None:
            for s in servers:
                assert client.request(s.endpoint, {"op": "x"})["ok"]

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del threads, t
        gc.collect()
        assert wait_until(lambda: client.open_sockets == 0, 5.0), client.open_sockets
        assert wait_until(lambda: sum(s.open_peers for s in servers) == 0, 5.0)
    finally:
        client.close()


class _GarbagePeer:
    """A listener on 127.0.0.1 that answers every request with a 1-byte frame that is not
    msgpack; counts the connections it accepted."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _one(conn: socket.socket) -> None:
        with conn:
            try:
                while conn.recv(65536):
                    conn.sendall(b"\x00\x00\x00\x01\xc1")
            except OSError:
                pass


def test_a_reply_that_is_not_msgpack_closes_the_connection() -> None:
    peer = _GarbagePeer()
    client = SideChannelClient(timeout_s=2.0)
    try:
        for n in range(1, 4):
            with pytest.raises(KVTransferError, match="not valid msgpack"):
                client.request(peer.endpoint, {"op": "holder"})
            assert client.open_sockets == 0
            assert wait_until(lambda n=n: peer.accepted == n, 5.0)  # a new one each time
    finally:
        client.close()
        peer.srv.close()


def test_an_unsealed_reply_to_a_keyed_client_closes_the_connection(
    servers: list[SideChannelServer],
) -> None:
    client = SideChannelClient(timeout_s=2.0, auth=KEY)
    try:
        with pytest.raises(KVPayloadError, match="not authenticated"):
            client.request(servers[0].endpoint, {"op": "x"})
        assert client.open_sockets == 0
    finally:
        client.close()


def test_boot_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_client, "MAX_BOOTS", 2)
    keyed = [SideChannelServer("127.0.0.1", 0, _echo, auth=KEY) for _ in range(3)]
    client = SideChannelClient(timeout_s=2.0, auth=KEY)
    try:
        for rnd in range(2):  # the first server's boot id was forgotten: learnt again
            for s in keyed:
                assert client.request(s.endpoint, {"op": "x", "x": rnd})["echo"] == rnd
                assert len(client._boots) <= 2
        assert list(client._boots) == [keyed[1].endpoint, keyed[2].endpoint]
    finally:
        client.close()
        for s in keyed:
            s.close()


def _holder_server(holder: str) -> SideChannelServer:
    def handle(msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") == "holder":
            return {"ok": True, "holder": holder}
        return {"ok": True, "lease": "l", "holder": holder, "seen": msg.get("holder")}

    return SideChannelServer("127.0.0.1", 0, handle)


def test_holder_ids_are_bounded_and_none_over_long_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sender_requests, "MAX_HOLDERS", 2)
    ids = [f"{i:064x}" for i in range(3)]
    senders = [_holder_server(h) for h in ids]
    long = _holder_server("h" * (MAX_HOLDER_CHARS + 1))
    reqs = SenderRequests(2.0, "e")
    try:
        for _ in range(2):
            for s, h in zip(senders, ids, strict=True):
                reply = reqs.acquire(s.endpoint, "k", 5.0, 1.0)
                assert reply is not None and reply["seen"] == h  # asked again once forgotten
                assert len(reqs._local.holders) <= 2
        assert reqs.acquire(long.endpoint, "k", 5.0, 1.0) is not None
        assert long.endpoint not in reqs._local.holders
    finally:
        reqs.close()
        for s in [*senders, long]:
            s.close()
