"""Loading a peer agent: its metadata over the side channel (op :data:`MD_OP`), checked,
loaded into our agent, and what its transfers will cross put on record; a peer's session
parsed (:func:`parse_session`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from vllm_omni_kv.backends.nixl.memory import (
    Span,
    device_read_warning,
    producer_writes,
    who_posts,
)
from vllm_omni_kv.backends.pull.pull_stream import MAX_SESSION, is_session
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: the side-channel op that returns an agent's metadata
MD_OP = "nixl_md"


def parse_session(session: str) -> tuple[str, str]:
    """``(agent name, side-channel endpoint)`` of a session ``agent@host:port`` (at most
    :data:`~vllm_omni_kv.backends.pull.pull_stream.MAX_SESSION` characters)."""
    name, sep, hostport = session.rpartition("@") if is_session(session) else ("", "", "")
    if not sep or not name or ":" not in hostport:
        raise KVTransferError(
            f"not a NIXL session: {session!r:.80} (expected 'agent@host:port', at most "
            f"{MAX_SESSION} characters); the sender is not a nixl backend, or its put "
            "metadata was altered"
        )
    return name, f"tcp://{hostport}"


def ask_metadata(
    client: SideChannelClient, endpoint: str, timeout_s: float, retries: int
) -> dict[str, Any]:
    """The ``MD_OP`` reply of ``endpoint``, in at most ``1 + retries`` tries."""
    tries = 1 + retries
    for i in range(tries):
        try:
            return client.request(endpoint, {"op": MD_OP}, timeout_s)
        except KVTransferTimeout as e:
            logger.warning("NIXL handshake with %s, try %d/%d: %s", endpoint, i + 1, tries, e)
    raise KVTransferTimeout(
        f"NIXL handshake with {endpoint} got no answer in {tries} tries of "
        f"{timeout_s:.1f}s: the sender is gone or unreachable "
        "(check its host / zmq_port and firewall)"
    )


def add_agent(
    agent: Any,
    md: bytes,
    name: str,
    where: str,
    stray: Callable[[str], None] | None = None,
) -> None:
    """Load ``md`` into ``agent``; it must name ``name``. Metadata that names another agent
    is refused, and ``stray`` is given the name it loaded (to unload it unless in use)."""
    try:
        loaded = agent.add_remote_agent(md)
    except Exception as e:
        raise KVTransferError(f"NIXL could not load {name!r}'s metadata: {e}") from None
    if isinstance(loaded, bytes):  # any bytes a peer's metadata names
        try:
            loaded = loaded.decode()
        except UnicodeDecodeError:  # not a name of ours, nor in use: unload it now
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(loaded)
            raise KVTransferError(f"NIXL metadata from {where} names {loaded!r}") from None
    loaded = str(loaded)
    if loaded != name:
        if stray is not None:
            stray(loaded)
        raise KVTransferError(f"NIXL metadata from {where} names {loaded!r}, not {name!r}")


def load_peer(
    agent: Any, own_name: str, name: str, endpoint: str, reply: dict[str, Any]
) -> list[Span]:
    """Check ``reply`` (from ``endpoint``, for agent ``name``), load it; the peer's spans."""
    if not reply.get("ok") or reply.get("agent") != name:
        raise KVTransferError(
            f"the side channel at {endpoint} does not serve NIXL agent {name!r} "
            f"(reply: {reply.get('error') or reply.get('agent')!r}): the sender restarted "
            "or is not a nixl backend; ask it for fresh metadata"
        )
    if name != own_name:  # a dual connector reads from itself through loopback
        md = reply.get("metadata")
        if not isinstance(md, bytes):
            raise KVTransferError(f"NIXL metadata from {endpoint}: no metadata bytes")
        add_agent(agent, md, name, endpoint)
    try:
        return [(int(a), int(n), str(m), int(d)) for a, n, m, d in reply.get("spans") or []]
    except (TypeError, ValueError):
        raise KVTransferError(f"NIXL metadata from {endpoint}: bad memory ranges") from None


def log_peer(
    name: str, endpoint: str, spans: list[Span], ours: list[Span], transport: str, direction: str
) -> None:
    """Log what a new peer's moves cross: its memory, ours, the transports allowed and who
    posts the moves out of each of its memories; warn where device memory would be READ on
    one host (UCX serves that by TCP)."""
    theirs = sorted({f"{m}:{d}" for _a, _n, m, d in spans})
    mine = sorted({f"{m}:{d}" for _a, _n, m, d in ours})
    logger.info(
        "NIXL peer %s at %s: its memory %s, this agent's %s, over %s; moves out of %s "
        "(nixl_direction %s)",
        name,
        endpoint,
        theirs or "none",
        mine or "none",
        transport,
        who_posts(direction, theirs),
        direction,
    )
    read = [m for m in theirs if not producer_writes(direction, m.split(":")[0])]
    warning = device_read_warning(read, endpoint)
    if warning:
        logger.warning("NIXL peer %s at %s: %s", name, endpoint, warning)
