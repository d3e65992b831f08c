"""Moves of NIXL's WRITE direction given up on whose writes may still land.

A producer's write cannot be stopped once posted (it answers an abort ``running`` until
the write ended), so a consumer that gives up on a move keeps its destination until no
write of it can land: each write ended (``D``/``E``), was answered ``done``, ``aborted``
or ``unknown``, or the producer's side channel refuses connections (its process is gone).
A paused producer is never judged gone. :class:`WaitOuts` does that for every such move
on one thread, a round of aborts each :data:`ROUND_S`, and completes the move's future
when it is over: no pull thread waits meanwhile. ``close`` completes them all (the agent
goes, and the producers' writes to it fail).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.pull.framing import split_endpoint
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.backends.resolve import connect
from vllm_omni_kv.errors import KVTransferError, OmniKVError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: pause between two rounds of aborts
ROUND_S = 0.1


@dataclass
class _Move:
    endpoint: str
    posted: dict[bytes, bytes]  # nonce -> the token it was last sent with, while it may land
    nonces: list[bytes] = field(default_factory=list)  # all of them, forgotten at the end
    ended: cf.Future[None] = field(default_factory=cf.Future)
    warned: bool = False


class WaitOuts:
    """Moves given up on, waited out on one thread. ``ended_of(nonces)`` is the
    notifications' view (the writes that ended), ``forget(nonces)`` drops them once a
    move is over."""

    def __init__(
        self,
        client: SideChannelClient,
        name: str,
        timeout_s: float,
        ended_of: Callable[[set[bytes]], dict[bytes, bytes]],
        forget: Callable[[list[bytes]], None],
    ) -> None:
        self._client, self._name, self._timeout_s = client, name, timeout_s
        self._ended_of, self._forget = ended_of, forget
        self._lock = threading.Condition()
        self._moves: list[_Move] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, endpoint: str, posted: dict[bytes, bytes]) -> cf.Future[None]:
        """Wait out the writes of ``posted`` at ``endpoint``; the future completes once
        none can land (at once when none was posted or all ended)."""
        move = _Move(endpoint, dict(posted), list(posted))
        if not self._left(move):
            return move.ended
        with self._lock:
            if self._closed:
                self._end(move)
                return move.ended
            self._moves.append(move)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omnikv-nixl-wait-out")
                self._thread.daemon = True
                self._thread.start()
            self._lock.notify()
        return move.ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._moves)

    def _left(self, move: _Move) -> bool:
        """Drop the writes that ended; ends ``move`` when none is left."""
        for n in self._ended_of(set(move.posted)):
            del move.posted[n]
        if move.posted:
            return True
        self._end(move)
        return False

    def _end(self, move: _Move) -> None:
        self._forget(move.nonces)
        try:
            move.ended.set_result(None)
        except cf.InvalidStateError:
            pass  # ended by ``close`` and the round at once

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._moves and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                moves = list(self._moves)
            over = [m for m in moves if self._round(m)]
            with self._lock:
                self._moves = [m for m in self._moves if m not in over]
            time.sleep(ROUND_S)

    def _round(self, move: _Move) -> bool:
        """One abort per write of ``move`` still running; True once none can land."""
        for n, token in list(move.posted.items()):
            try:
                abort = ww.with_token(ww.abort_msg(self._name, n), token)
                reply = self._client.request(move.endpoint, abort, self._timeout_s)
            except (OmniKVError, OSError) as e:
                if _gone(move.endpoint):
                    self._end(move)
                    return True
                if not move.warned:
                    move.warned = True
                    logger.warning(
                        "NIXL write abort at %s not answered (%s); its memory stays held "
                        "until the producer answers or is gone",
                        move.endpoint,
                        e,
                    )
                continue
            if reply.get("ok") and reply.get("state") != "running":
                del move.posted[n]
        return not self._left(move)

    def close(self) -> None:
        """Complete every move's future (the agent goes)."""
        with self._lock:
            self._closed = True
            moves, self._moves = self._moves, []
            self._lock.notify_all()
        for m in moves:
            if not m.ended.done():
                self._end(m)


def _gone(endpoint: str) -> bool:
    """Whether nothing listens at ``endpoint`` any more (connection refused)."""
    host, port = split_endpoint(endpoint)
    try:
        with connect(host, port, time.monotonic() + 1.0):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, KVTransferError):  # a name that does not resolve proves nothing
        return False
