"""Moves of the WRITE direction given up on (:class:`~vllm_omni_kv.backends.nixl.wait_outs.WaitOuts`):
a move's future completes only once none of its writes can land, without a pull thread
waiting. The producer here is a real side channel whose handler answers aborts as a
producer does (``running`` while a write runs); notifications are a dict.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.wait_outs import WaitOuts
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient, SideChannelServer

TOKEN = bytes(ww.NONCE_BYTES)


class _Producer:
    """Answers each abort ``running`` until its nonce's write ``ends_at``, then ``aborted``."""

    def __init__(self, runs: dict[bytes, float]) -> None:
        now = time.monotonic()
        self.ends_at = {n: now + s for n, s in runs.items()}
        self.aborts: list[bytes] = []
        self.server = SideChannelServer("127.0.0.1", 0, self.answer)

    def answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        nonce = ww.nonce_of(msg)
        self.aborts.append(nonce)
        running = time.monotonic() < self.ends_at.get(nonce, 0.0)
        return {"ok": True, "state": "running" if running else "aborted"}


def _wait_outs(ended: dict[bytes, bytes], forgotten: list[bytes]) -> tuple[WaitOuts, Any]:
    client = SideChannelClient(2.0)

    def ended_of(nonces: set[bytes]) -> dict[bytes, bytes]:
        return {n: ended[n] for n in nonces if n in ended}

    return WaitOuts(client, "consumer", 2.0, ended_of, forgotten.extend), client


def test_a_move_is_over_once_each_write_ended_or_was_answered_over() -> None:
    a, b, c = (bytes([i]) * ww.NONCE_BYTES for i in (1, 2, 3))
    producer = _Producer({a: 0.3, b: 3600})
    ended: dict[bytes, bytes] = {c: b"D"}
    forgotten: list[bytes] = []
    waits, client = _wait_outs(ended, forgotten)
    try:
        move = waits.add(producer.server.endpoint, {a: TOKEN, b: TOKEN, c: TOKEN})
        time.sleep(0.2)
        assert not move.done()
        threading.Timer(0.5, ended.__setitem__, (b, b"E")).start()  # its notification comes
        assert move.result(timeout=10) is None
        assert a in producer.aborts and c not in producer.aborts  # c had ended already
        assert sorted(forgotten) == sorted([a, b, c])  # their notifications are dropped
        assert len(waits) == 0
    finally:
        waits.close()
        client.close()
        producer.server.close()


def test_a_move_whose_writes_all_ended_is_over_at_once() -> None:
    n = b"\x07" * ww.NONCE_BYTES
    waits, client = _wait_outs({n: b"D"}, [])
    try:
        assert waits.add("tcp://127.0.0.1:1", {n: TOKEN}).done()
        assert waits.add("tcp://127.0.0.1:1", {}).done()
    finally:
        waits.close()
        client.close()


def test_a_producer_whose_side_channel_refuses_connections_ends_the_wait() -> None:
    """Its process is gone: no write of it can land any more. While it answers (here:
    ``running``) the move is never judged over."""
    n = b"\x09" * ww.NONCE_BYTES
    producer = _Producer({n: 3600})
    waits, client = _wait_outs({}, [])
    try:
        move = waits.add(producer.server.endpoint, {n: TOKEN})
        time.sleep(0.5)
        assert not move.done()
        producer.server.close()
        assert move.result(timeout=15) is None
    finally:
        waits.close()
        client.close()
