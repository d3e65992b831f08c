"""What a pull receiver asks its senders over the side channel: ``acquire`` (retried until
the key appears or the wait ends), ``release`` and ``extend``; and which sender a get
addresses (:class:`SenderEndpoints`).

Leases are held per receiver thread: when a busy sender answers an acquire after the
receiver gave up waiting, the receiver's retry replaces that orphan lease instead of finding
the key "exhausted" until the lease lapses. A thread names itself to a sender by the holder
id that sender issued it (:mod:`.sender_ops`: asked for before the thread's first acquire
there, renewed by every acquire reply); a thread remembers the ids of at most
:data:`MAX_HOLDERS` senders (the least recently used one is forgotten, and asked for again),
and none longer than :data:`MAX_HOLDER_CHARS`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.wire.auth import AuthKey

__all__ = ["MAX_HOLDERS", "MAX_HOLDER_CHARS", "SenderEndpoints", "SenderRequests"]

#: senders whose holder id one thread remembers (the least recently used one is forgotten)
MAX_HOLDERS = 256
#: the longest holder id kept (a sender issues 64 hex digits; a longer one is ignored)
MAX_HOLDER_CHARS = 128


class SenderEndpoints:
    """The default sender and per-rank senders a receiver knows (``tcp://host:port``)."""

    def __init__(self, host: str | None = None, zmq_port: int | str | None = None) -> None:
        self.host = host
        self.zmq_port: int | None = None if zmq_port is None else int(zmq_port)
        self._ranks: dict[int, tuple[str, int]] = {}

    def update(self, host: str, zmq_port: int, rank: int | None = None) -> None:
        """Set the default sender (``rank=None``) or the endpoint of one sender rank."""
        if rank is None:
            self.host, self.zmq_port = host, int(zmq_port)
        else:
            self._ranks[int(rank)] = (host, int(zmq_port))

    def resolve(self, metadata: dict[str, Any] | None) -> str:
        """``metadata``'s ``source_host``/``source_port``, else its sender rank's endpoint,
        else the default sender."""
        md = metadata or {}
        if md.get("source_host") and md.get("source_port"):
            return f"tcp://{md['source_host']}:{_number(md, 'source_port')}"
        rank = md.get("sender_rank", md.get("from_rank"))
        if rank is not None and (n := _number(md, "sender_rank", "from_rank")) in self._ranks:
            h, p = self._ranks[n]
            return f"tcp://{h}:{p}"
        if self.host and self.zmq_port:
            return f"tcp://{self.host}:{self.zmq_port}"
        raise KVTransferError(
            "no sender endpoint known for get(): pass metadata with source_host/source_port, "
            "or call update_sender_info(host, zmq_port) first"
        )


def _number(md: dict[str, Any], *keys: str) -> int:
    """The integer under the first of ``keys`` that ``md`` has, else ``KVTransferError``."""
    key = next(k for k in keys if k in md)
    try:
        return int(md[key])
    except (TypeError, ValueError, OverflowError):
        raise KVTransferError(f"metadata {key} must be an integer, got {md[key]!r}") from None


class SenderRequests:
    """One receiver's side-channel client; every request is bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float, engine_id: str, auth: AuthKey | None = None) -> None:
        self._client = SideChannelClient(timeout_s, auth=auth)
        self._engine_id = engine_id
        self._local = threading.local()  # .holders: endpoint -> this thread's holder id

    def acquire(
        self, endpoint: str, key: str, lease_s: float, wait_s: float
    ) -> dict[str, Any] | None:
        """Lease ``key`` for ``lease_s``: the sender's reply (address, size, kind, and a
        lease id: a reply without one raises), or None when the key did not appear within
        ``wait_s``."""
        deadline = time.monotonic() + wait_s
        delay = 0.005
        # one thread's gets are sequential: naming this thread by its holder id lets the
        # sender replace a lease this thread abandoned when an earlier acquire timed out
        holders: OrderedDict[str, str] = self._local.__dict__.setdefault("holders", OrderedDict())
        if endpoint in holders:
            holders.move_to_end(endpoint)
        else:
            self._learn_holder(holders, endpoint, self._client.request(endpoint, {"op": "holder"}))
        msg: dict[str, Any] = {"op": "acquire", "key": key, "lease_s": lease_s}
        while True:
            if endpoint in holders:
                msg["holder"] = holders[endpoint]
            reply = self._client.request(endpoint, msg)
            self._learn_holder(holders, endpoint, reply)
            if reply.get("ok"):
                if type(reply.get("lease")) is not str:
                    raise KVTransferError(
                        f"sender at {endpoint} granted {key!r} without a lease id"
                    )
                return reply
            if reply.get("reason") == "error":
                raise KVTransferError(f"sender at {endpoint} failed: {reply.get('error')}")
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    @staticmethod
    def _learn_holder(holders: OrderedDict[str, str], endpoint: str, reply: dict[str, Any]) -> None:
        holder = reply.get("holder")
        if isinstance(holder, str) and 0 < len(holder) <= MAX_HOLDER_CHARS:
            holders[endpoint] = holder
            holders.move_to_end(endpoint)
            while len(holders) > MAX_HOLDERS:
                holders.popitem(last=False)

    def release(
        self, endpoint: str, key: str, token: str, lease: str | None, success: bool
    ) -> dict[str, Any]:
        """Tell the sender a pull of ``key`` ended; its reply's ``ok`` confirms the block
        stayed live. Raises ``KVTransferError`` when the sender does not answer."""
        msg = {"op": "release", "key": key, "token": token, "lease": lease, "success": success}
        return self._client.request(endpoint, msg)

    def extend(self, endpoint: str, key: str, seconds: float) -> dict[str, Any]:
        """Ask the sender to keep ``key`` ``seconds`` longer (``ok``: it is still there).
        Raises ``KVTransferError`` when the sender does not answer."""
        return self._client.request(endpoint, {"op": "extend", "key": key, "lease_s": seconds})

    def close(self) -> None:
        self._client.close()
