"""A real sender (Mooncake TE, in its own process) under a network attacker's side-channel
attacks: floods of peers and of max-size messages with and without the key (bounded
memory, legitimate acquires still served), a flood of releases (acquires never locked
out), keyed requests replayed to another sender or to a restarted one (refused),
forged holder ids (nobody else's lease dropped), endless acquires of a block every
receiver may pull (a bounded lease table) and requests whose op is not a string (refused
and charged)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from vllm_omni_kv.backends.pull.envelope import body_of, open_header, seal
from vllm_omni_kv.backends.pull.exposure import MAX_LEASES
from vllm_omni_kv.backends.pull.sender_requests import SenderRequests
from vllm_omni_kv.backends.pull.side_channel import (
    MAX_PEERS,
    MAX_REQUEST,
    MAX_SKEW_S,
    SideChannelClient,
    pack,
)
from vllm_omni_kv.wire.auth import AuthKey, load_key_file

from ..conformance import SenderProcess, te_config, wait_until
from .raw_peer import connect, raw_request, read_frame

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
pytestmark = pytest.mark.mooncake

FLOODER = Path(__file__).with_name("flood_peers.py")
KEY = "k@0->1"  # the sender's put of "k" from stage 0 to stage 1
#: the sender's growth allowed: what it buffers for its peers is at most MAX_PEERS x
#: (MAX_REQUEST + one reply), 4.3 MiB, plus the allocator's slack, which grows with the
#: rate of requests and the machine's load (measured: 0.3-8.5 MiB alone, 20-24 MiB twice in
#: full parallel runs at 40,000-100,000 requests). With a ZeroMQ ROUTER (per-peer queues,
#: any number of peers), 320 peers of 64 KiB grew a sender by 149 MiB in 4 s
RSS_BOUND = 48 << 20
OTHER = AuthKey(b"not-the-deployment-key-" + bytes(range(32)))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "omnikv.key"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


def _sender(key_file: Path | None, **over: Any) -> tuple[SenderProcess, str]:
    cfg = te_config("sender", pool_mib=8, max_pulls=0, **over)
    if key_file is not None:
        cfg["auth_key_file"] = str(key_file)
    proc = SenderProcess(cfg)
    meta = proc.call(op="put", key="k", data=torch.ones(1024))["meta"]
    return proc, f"tcp://{meta['source_host']}:{meta['source_port']}"


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[SenderProcess, str]]:
    proc, endpoint = _sender(None)
    yield proc, endpoint
    proc.stop()


@pytest.fixture
def slow() -> Iterator[tuple[SenderProcess, str]]:
    """A sender that answers 2,000 requests/s (beyond them: busy)."""
    proc, endpoint = _sender(None, side_channel_max_rate=2000)
    yield proc, endpoint
    proc.stop()


@pytest.fixture(scope="module")
def keyed(key_file: Path) -> Iterator[tuple[SenderProcess, str]]:
    proc, endpoint = _sender(key_file)
    yield proc, endpoint
    proc.stop()


def _memory(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) << 10
    return out


def _flood(endpoint: str, peers: int, seconds: float, payloads: list[bytes], where: Path) -> Any:
    files = []
    for i, p in enumerate(payloads):
        files.append(where / f"payload{i}")
        files[-1].write_bytes(p)
    args = [sys.executable, str(FLOODER), endpoint, str(peers), str(seconds), *map(str, files)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def _acquire_and_release(client: SenderRequests, endpoint: str) -> bool:
    reply = client.acquire(endpoint, KEY, 5.0, 5.0)
    if reply is None or not reply["ok"]:
        return False
    return bool(client.release(endpoint, KEY, "", reply["lease"], False)["ok"])


def _max_size_payloads() -> list[bytes]:
    """Messages of exactly MAX_REQUEST bytes: random bytes, a keyed envelope made with
    another key, and a valid unkeyed request padded to the limit."""
    sealed = seal({"op": "acquire", "key": KEY}, OTHER, nonce=os.urandom(16), boot=bytes(16))
    padded = pack({"op": "ping", "pad": b"x" * (MAX_REQUEST - 20)})  # bin 16: 3-byte head
    padded = pack({"op": "ping", "pad": b"x" * (MAX_REQUEST - 20 + MAX_REQUEST - len(padded))})
    out = [os.urandom(MAX_REQUEST), sealed + os.urandom(MAX_REQUEST - len(sealed)), padded]
    assert all(len(p) == MAX_REQUEST for p in out), [len(p) for p in out]
    return out


@pytest.mark.parametrize("mode", ["keyed", "plain"])
def test_a_flood_of_peers_and_max_size_messages_keeps_the_sender_small_and_serving(
    mode: str, request: pytest.FixtureRequest, key_file: Path, tmp_path: Path
) -> None:
    proc, endpoint = request.getfixturevalue(mode)
    auth = load_key_file(key_file) if mode == "keyed" else None
    legit = SenderRequests(5.0, "consumer", auth=auth)  # connected before the flood
    pid = proc.proc.pid
    assert pid is not None
    try:
        assert _acquire_and_release(legit, endpoint)
        before = _memory(pid)["VmRSS"]
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
        flood = _flood(endpoint, MAX_PEERS + 144, 3.0, _max_size_payloads(), tmp_path)
        ok = failed = 0
        while flood.poll() is None:
            try:
                ok += _acquire_and_release(legit, endpoint)
            except Exception:
                failed += 1
        sent = json.loads(flood.communicate(timeout=30)[0])["sent"]
        grown = _memory(pid)["VmHWM"] - before
        assert grown < RSS_BOUND, f"{grown / 2**20:.1f} MiB after {sent} messages"
        assert sent > 4 * MAX_PEERS, sent
        assert failed == 0 and ok >= 10, (ok, failed)
        health = proc.call(op="health")["health"]
        assert health["peers_refused"] > 0, "the flood never reached the peer cap"
        assert wait_until(lambda: proc.call(op="health")["health"]["peers"] <= 1, 10)
        fresh = SenderRequests(5.0, "late-consumer", auth=auth)  # a peer slot is free again
        try:
            assert _acquire_and_release(fresh, endpoint)
        finally:
            fresh.close()
    finally:
        legit.close()


#: what a sender may keep after each further flood of the same shape (its memory after a
#: first flood is reused, so a leak of even 64 bytes per request shows over 3 floods)
LEAK_BOUND = 6 << 20


def test_repeated_floods_leave_the_sender_no_larger_than_the_first(tmp_path: Path) -> None:
    """The first flood settles the allocator's arenas; the sender's resident memory after
    three more floods of the same shape, each followed by the peers leaving, stays within
    :data:`LEAK_BOUND` of that. A per-message or per-connection leak grows with the
    messages sent (tens of thousands per flood)."""
    proc, endpoint = _sender(None)
    try:
        pid = proc.proc.pid
        assert pid is not None
        resident, sent = [], []
        for _ in range(4):
            flood = _flood(endpoint, MAX_PEERS + 144, 1.5, _max_size_payloads(), tmp_path)
            sent.append(json.loads(flood.communicate(timeout=30)[0])["sent"])
            assert wait_until(lambda: proc.call(op="health")["health"]["peers"] == 0, 10)
            resident.append(_memory(pid)["VmRSS"])
        grown = max(resident[1:]) - resident[0]
        assert grown < LEAK_BOUND, (
            f"{grown / 2**20:.1f} MiB kept after {sum(sent[1:])} more requests: "
            f"{[r >> 20 for r in resident]} MiB"
        )
        assert min(sent) > 4 * MAX_PEERS, sent
    finally:
        proc.stop()


def test_a_flood_of_releases_never_makes_acquires_busy(
    slow: tuple[SenderProcess, str], tmp_path: Path
) -> None:
    """The sender answers 2,000 requests/s; the flood sends releases far faster, and every
    acquire during and right after it is still served (releases never drain the budget)."""
    _proc, endpoint = slow
    release = pack({"op": "release", "lease": "0" * 32, "success": True})
    client = SideChannelClient(5.0)
    acquire = {"op": "acquire", "key": KEY, "lease_s": 5.0}
    replies: list[str] = []
    try:
        flood = _flood(endpoint, 16, 3.0, [release], tmp_path)
        time.sleep(0.5)  # the flood is on
        while flood.poll() is None:
            reply = client.request(endpoint, acquire)
            replies.append("ok" if reply["ok"] else str(reply.get("reason")))
            if reply["ok"]:
                client.request(endpoint, {"op": "release", "lease": reply["lease"]})
            time.sleep(0.005)  # ~100 acquires/s: well within the budget
        sent = json.loads(flood.communicate(timeout=30)[0])["sent"]
        assert sent > 3 * 2000, f"the flood sent {sent} releases only"
        after = client.request(endpoint, acquire)
        assert after["ok"], after
        client.request(endpoint, {"op": "release", "lease": after["lease"]})
    finally:
        client.close()
    assert replies and set(replies) == {"ok"}, {r: replies.count(r) for r in set(replies)}


def _recording_proxy(target: str) -> tuple[str, list[bytes], threading.Event, threading.Thread]:
    """A man in the middle: forwards each connection's requests to ``target`` (a new
    connection there per client connection) and records every request."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    seen: list[bytes] = []
    stop = threading.Event()

    def relay(client: socket.socket) -> None:
        with client, connect(target, timeout=10.0) as server:
            client.settimeout(10.0)
            while (request := read_frame(client)) is not None:
                seen.append(request)
                server.sendall(struct.pack(">I", len(request)) + request)
                reply = read_frame(server)
                if reply is None:
                    return
                client.sendall(struct.pack(">I", len(reply)) + reply)

    def run() -> None:
        with listener:
            while not stop.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=relay, args=(client,), daemon=True).start()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{listener.getsockname()[1]}", seen, stop, t


def _replayed(endpoint: str, raw: bytes, auth: AuthKey) -> dict[str, Any]:
    """Send captured bytes from a bare socket; the reply, opened with the deployment key."""
    reply = raw_request(endpoint, raw, timeout=5.0)
    assert reply is not None
    header = open_header(reply, auth, reply=True)
    body = reply if header is None else body_of(reply, header)
    assert body is not None
    out: dict[str, Any] = msgpack.unpackb(body)
    return out


def test_a_keyed_request_replayed_elsewhere_or_after_a_restart_is_refused(
    keyed: tuple[SenderProcess, str], key_file: Path
) -> None:
    other_proc, other = keyed  # another sender of the same deployment (same key)
    auth = load_key_file(key_file)
    proc, endpoint = _sender(key_file)
    port = int(endpoint.rsplit(":", 1)[1])
    proxy, seen, stop, t = _recording_proxy(endpoint)
    client = SideChannelClient(5.0, auth=auth)
    try:
        first = client.request(proxy, {"op": "acquire", "key": KEY, "lease_s": 5.0})
        assert first["ok"]
        captured, captured_at = seen[-1], time.monotonic()  # the acquire as it crossed the network
        assert _replayed(endpoint, captured, auth)["error"].endswith("(a replay)")
        assert _replayed(other, captured, auth) == {"ok": False, "reason": "retarget"}
        assert other_proc.call(op="health")["health"]["active_leases"] == 0
        proc.stop()  # the sender restarts on the same port, with the same key
        proc, _ = _sender(key_file, zmq_port=port)
        replayed = _replayed(endpoint, captured, auth)
        if time.monotonic() - captured_at < MAX_SKEW_S - 2:
            assert replayed == {"ok": False, "reason": "retarget"}
        else:  # a loaded machine took the skew window to restart: refused as too old
            assert replayed["reason"] == "unauthenticated" and "timestamp" in replayed["error"]
        assert proc.call(op="health")["health"]["active_leases"] == 0
        again = client.request(proxy, {"op": "acquire", "key": KEY, "lease_s": 5.0})
        assert again["ok"], "the client did not learn the restarted sender's boot id"
    finally:
        client.close()
        stop.set()
        t.join(5)
        proc.stop()


def test_a_forged_holder_cannot_drop_anothers_lease(plain: tuple[SenderProcess, str]) -> None:
    proc, endpoint = plain
    victim = SenderRequests(5.0, "victim-engine")
    attacker = SideChannelClient(5.0)
    try:
        lease = victim.acquire(endpoint, KEY, 5.0, 5.0)
        assert lease is not None and lease["ok"]
        issued = attacker.request(endpoint, {"op": "holder"})["holder"]  # the attacker's own
        forged = [
            f"victim-engine:{threading.get_ident()}",  # the id receivers used to choose
            "0" * 64,
            os.urandom(32).hex(),
            issued[:32] + lease["holder"][32:],
            issued,
        ]
        for holder in forged:
            reply = attacker.request(endpoint, {"op": "acquire", "key": KEY, "holder": holder})
            assert reply["ok"] and reply["holder"] != lease["holder"]
            # an id this sender did not issue is not taken: the acquire gets a fresh one
            assert (reply["holder"] == holder) == (holder == issued), holder
            attacker.request(endpoint, {"op": "release", "lease": reply["lease"]})
        # the victim's lease survived every forgery: its release confirms its pull
        assert victim.release(endpoint, KEY, "", lease["lease"], False) == {"ok": True}
    finally:
        attacker.close()
        victim.close()


def test_a_peer_that_acquires_without_end_holds_at_most_max_leases() -> None:
    """A block every receiver may pull (``max_pulls: 0``) is leased to at most
    ``MAX_LEASES`` pulls at once: a peer that acquires again and again (naming no holder,
    so each acquire is a new receiver) gets "exhausted" past them, the sender's lease
    table stops growing, and a lease given back makes room for the next receiver."""
    proc, endpoint = _sender(None)
    client = SideChannelClient(5.0)
    acquire = {"op": "acquire", "key": KEY, "lease_s": 60.0}
    try:
        replies = [client.request(endpoint, acquire) for _ in range(MAX_LEASES + 20)]
        granted = [r["lease"] for r in replies if r["ok"]]
        assert len(granted) == MAX_LEASES, len(granted)
        assert {r.get("reason") for r in replies if not r["ok"]} == {"exhausted"}
        assert proc.call(op="health")["health"]["active_leases"] == MAX_LEASES
        client.request(endpoint, {"op": "release", "lease": granted[0], "success": True})
        assert client.request(endpoint, acquire)["ok"]
    finally:
        client.close()
        proc.stop()


def test_an_op_that_is_not_a_string_is_refused_and_charged() -> None:
    """A request whose ``op`` is a list or a map (unhashable) is answered with an error,
    and pays the rate limit like any request: past the budget the sender says busy."""
    proc, endpoint = _sender(None, side_channel_max_rate=5)
    client = SideChannelClient(5.0)
    try:
        replies = [client.request(endpoint, {"op": op}) for op in ([1], {"a": 1}) * 20]
        reasons = [r.get("reason") for r in replies]
        assert not any(r["ok"] for r in replies)
        assert set(reasons) == {"error", "busy"}, reasons
        assert all("unknown side-channel op" in r["error"] for r in replies if "error" in r)
    finally:
        client.close()
        proc.stop()
