"""The side-channel messages of NIXL's WRITE direction, built by the consumer and parsed
strictly by the producer.

In the WRITE direction a consumer does not READ a producer's memory: it asks the producer
to WRITE into its own registered memory (UCX serves a WRITE of GPU memory by ``cuda_ipc``
or RDMA where a READ of it may fall back to TCP). Four ops:

- ``nixl_sink`` ``{agent, md, spans, tokens}``: the consumer's NIXL metadata and registered
  ranges. The producer loads the metadata and sends the agent it names a NIXL notification
  ``C`` + challenge + :func:`sink_digest` of the request (so that agent answers only its own
  requests); the consumer proves it is that agent with ``nixl_sink`` ``{agent, proof}`` (the
  challenge), and only then may writes go to it. So metadata a client copied from another
  agent (a dual connector serves its own) never lets it aim writes at that agent. A proven
  sink's metadata is replaced only by a request carrying its token in ``tokens`` (at most
  :data:`MAX_TOKENS`: the consumer's last proven one and the last challenge it answered);
- ``nixl_tables`` ``{agent, token, id, src, dst}``: a pair of page-table sets (producer's
  source, consumer's destination; rows ``(base, stride, page bytes, count)``) under an id;
- ``nixl_write`` ``{agent, token, nonce, ttl_s, tables, groups}`` (pages by index, groups of
  ``(layers, pairs)`` as little-endian int32; each layer once, each destination page once) or
  ``{agent, token, nonce, ttl_s, ranges}`` (``(destination, source, bytes)`` rows as
  little-endian uint64, destinations disjoint); answered at once, the end of the write
  comes as a NIXL notification ``D``/``E`` + nonce;
- ``nixl_write_abort`` ``{agent, token, nonce}``: stop that write; ``{state}`` says what it
  was.

``token`` is the challenge of the sink's last proof (:func:`with_token`): only the proven
agent and the producer know it, so a client that can reach the side channel but not
receive the agent's notifications can neither aim writes or table sets at that sink nor
abort its writes. (Against a client that can read the side channel's traffic, set an
``auth_key_file``: the keyed envelope then refuses every request not sealed with the key.)

Every field is checked here (type, size, range) before the producer acts on it; a
malformed message raises :class:`~vllm_omni_kv.errors.KVTransferError`, which the side
channel answers as an error.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_omni_kv.backends.nixl.memory import Span
from vllm_omni_kv.backends.pull.page_reads import Group, PageReads, PageTable, group_ids
from vllm_omni_kv.errors import KVTransferError

SINK_OP, TABLES_OP, WRITE_OP, ABORT_OP = (
    "nixl_sink",
    "nixl_tables",
    "nixl_write",
    "nixl_write_abort",
)
WRITE_OPS = frozenset({SINK_OP, TABLES_OP, WRITE_OP, ABORT_OP})
NONCE_BYTES = 16
#: page pairs (or byte ranges) per ``nixl_write``: the message stays under the side
#: channel's request bound (16 KiB) with its envelope
MAX_PAIRS = 1536
MAX_RANGES = 512
MAX_TABLES = 256
MAX_SPANS = 64
MAX_MD = 8 << 10
MAX_NAME = 128
#: tokens a ``nixl_sink`` may carry (its sender's last proven one and its last challenge)
MAX_TOKENS = 2
#: page indices into a table set's prepared list are int32 (NIXL's index lists)
MAX_INDEX = 2**31 - 1
#: the longest a producer lets one write run (seconds)
MAX_TTL_S = 600.0
_U64 = 2**64


@dataclass(frozen=True)
class PageGroup:
    """Layers of a table set (its id: ``tables``) moving the same ``(source page,
    destination page)`` pairs; indices checked by :func:`page_ids`."""

    tables: bytes
    layers: np.ndarray
    pairs: np.ndarray


@dataclass(frozen=True)
class WriteRequest:
    agent: str
    token: bytes
    nonce: bytes
    ttl_s: float
    pages: PageGroup | None  # pages by index into a table set ...
    ranges: np.ndarray | None  # ... or ``[n, 3]`` (destination, source, bytes) rows


# -- the consumer's side ---------------------------------------------------------------
def tables_id(src: tuple[PageTable, ...], dst: tuple[PageTable, ...]) -> bytes:
    """A table set's id: a digest of its rows."""
    return hashlib.blake2b(_rows(src) + b"|" + _rows(dst), digest_size=16).digest()


def _rows(tables: tuple[PageTable, ...]) -> bytes:
    rows = [(t.base, t.stride, t.page_bytes, t.count) for t in tables]
    return np.asarray(rows, dtype="<u8").reshape(-1, 4).tobytes()


def sink_msg(agent: str, md: bytes, spans: list[Span], tokens: list[bytes]) -> dict[str, Any]:
    """A ``nixl_sink`` request; ``tokens``: this agent's tokens at the producer (if any)."""
    return {
        "op": SINK_OP,
        "agent": agent,
        "md": md,
        "spans": [list(s) for s in spans],
        "tokens": tokens[-MAX_TOKENS:],
    }


def sink_digest(md: bytes, spans: list[Span]) -> bytes:
    """What a challenge answers: a digest of the ``nixl_sink`` request's metadata and spans."""
    h = hashlib.blake2b(md, digest_size=16)
    for addr, size, kind, dev in spans:
        h.update(f"|{addr},{size},{kind},{dev}".encode())
    return h.digest()


def challenge_notif(challenge: bytes, digest: bytes) -> bytes:
    """The notification a producer sends the agent a ``nixl_sink`` names."""
    return b"C" + challenge + digest


def parse_challenge(m: bytes) -> tuple[bytes, bytes] | None:
    """``(challenge, sink digest)`` of a challenge notification; None for anything else."""
    if len(m) != 1 + 2 * NONCE_BYTES or m[:1] != b"C":
        return None
    return m[1 : 1 + NONCE_BYTES], m[1 + NONCE_BYTES :]


def proof_msg(agent: str, challenge: bytes) -> dict[str, Any]:
    return {"op": SINK_OP, "agent": agent, "proof": challenge}


def tables_msg(agent: str, reads: PageReads) -> dict[str, Any]:
    """The table set of ``reads``: the producer's tables are ``reads.remote``."""
    return {
        "op": TABLES_OP,
        "agent": agent,
        "id": tables_id(reads.remote, reads.local),
        "src": _rows(reads.remote),
        "dst": _rows(reads.local),
    }


def page_write_msgs(agent: str, reads: PageReads, ttl_s: float) -> list[dict[str, Any]]:
    """``nixl_write`` messages for ``reads`` (one per :data:`MAX_PAIRS` pairs of a group)."""
    tid = tables_id(reads.remote, reads.local)
    out: list[dict[str, Any]] = []
    for layers, pairs in reads.groups:
        for at in range(0, len(pairs), MAX_PAIRS):
            part = pairs[at : at + MAX_PAIRS].astype("<i4").tobytes()
            group = [layers.astype("<i4").tobytes(), part]
            out.append(_write(agent, ttl_s, {"tables": tid, "groups": [group]}))
    return out


def range_write_msgs(
    agent: str, reads: list[tuple[int, int, int]], ttl_s: float
) -> list[dict[str, Any]]:
    """``nixl_write`` messages for ``(destination, source, bytes)`` ranges."""
    rows = np.asarray(reads, dtype="<u8").reshape(-1, 3)
    return [
        _write(agent, ttl_s, {"ranges": rows[at : at + MAX_RANGES].tobytes()})
        for at in range(0, len(rows), MAX_RANGES)
    ]


def _write(agent: str, ttl_s: float, body: dict[str, Any]) -> dict[str, Any]:
    nonce = os.urandom(NONCE_BYTES)
    ttl = min(float(ttl_s), MAX_TTL_S)  # a longer transfer_timeout_s: the producer's bound
    return {"op": WRITE_OP, "agent": agent, "nonce": nonce, "ttl_s": ttl, **body}


def abort_msg(agent: str, nonce: bytes) -> dict[str, Any]:
    return {"op": ABORT_OP, "agent": agent, "nonce": nonce}


def with_token(msg: dict[str, Any], token: bytes) -> dict[str, Any]:
    """``msg`` (tables, write or abort) carrying the sink's token (its last proof)."""
    return {**msg, "token": token}


# -- the producer's side ---------------------------------------------------------------
def _bad(what: str) -> KVTransferError:
    return KVTransferError(f"malformed NIXL write request: {what}")


def _blob(v: Any, key: str, most: int, exact: int | None = None) -> bytes:
    if not isinstance(v, bytes) or len(v) > most or (exact is not None and len(v) != exact):
        raise _bad(f"{key} must be bytes ({exact or f'at most {most}'})")
    return v


def _bytes(msg: dict[str, Any], key: str, most: int, exact: int | None = None) -> bytes:
    return _blob(msg.get(key), key, most, exact)


def nonce_of(msg: dict[str, Any]) -> bytes:
    """The nonce of a ``nixl_write_abort``."""
    return _bytes(msg, "nonce", NONCE_BYTES, NONCE_BYTES)


def token_of(msg: dict[str, Any]) -> bytes:
    """The sink token of a tables, write or abort message."""
    return _bytes(msg, "token", NONCE_BYTES, NONCE_BYTES)


def agent_of(msg: dict[str, Any]) -> str:
    v = msg.get("agent")
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME or not v.isprintable():
        raise _bad("agent must be a printable name")
    return v


def parse_proof(msg: dict[str, Any]) -> tuple[str, bytes] | None:
    """``(agent, challenge)`` of a ``nixl_sink`` proof; None for a metadata message."""
    if "proof" not in msg:
        return None
    return agent_of(msg), _bytes(msg, "proof", NONCE_BYTES, NONCE_BYTES)


def parse_sink(msg: dict[str, Any]) -> tuple[str, bytes, list[Span], list[bytes]]:
    """``(agent, metadata, spans, tokens)`` of a ``nixl_sink`` metadata message."""
    tokens = msg.get("tokens", [])
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        raise _bad(f"tokens must be a list of at most {MAX_TOKENS}")
    toks = [_blob(t, "a token", NONCE_BYTES, NONCE_BYTES) for t in tokens]
    spans = msg.get("spans")
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise _bad(f"spans must be a list of at most {MAX_SPANS}")
    out: list[Span] = []
    for s in spans:
        ok = (
            isinstance(s, list)
            and len(s) == 4
            and isinstance(s[2], str)
            and s[2] in ("DRAM", "VRAM")
        )
        if not ok or not all(isinstance(x, int) and 0 <= x < _U64 for x in (s[0], s[1], s[3])):
            raise _bad("a span is [address, bytes, 'DRAM'|'VRAM', device]")
        out.append((s[0], s[1], s[2], s[3]))
    return agent_of(msg), _bytes(msg, "md", MAX_MD), out, toks


def _tables(raw: bytes, key: str) -> tuple[PageTable, ...]:
    if len(raw) % 32 or not 0 < len(raw) // 32 <= MAX_TABLES:
        raise _bad(f"{key} must hold 1 to {MAX_TABLES} rows of 4 uint64")
    rows = np.frombuffer(raw, dtype="<u8").reshape(-1, 4)
    tables = tuple(PageTable(int(a), int(s), int(p), int(c)) for a, s, p, c in rows.tolist())
    for t in tables:
        if not (0 < t.page_bytes <= t.stride or t.count == 1) or not 0 < t.count < 2**31:
            raise _bad(f"{key}: a table's pages overlap, or it has no page")
        if t.base + (t.count - 1) * t.stride + t.page_bytes >= _U64:
            raise _bad(f"{key}: a table runs past the address space")
    return tables


def parse_tables(
    msg: dict[str, Any],
) -> tuple[str, bytes, tuple[PageTable, ...], tuple[PageTable, ...]]:
    """``(agent, id, source tables, destination tables)``; the id must be the rows' digest."""
    tid = _bytes(msg, "id", 16, 16)
    src = _tables(_bytes(msg, "src", MAX_TABLES * 32), "src")
    dst = _tables(_bytes(msg, "dst", MAX_TABLES * 32), "dst")
    if len(src) != len(dst) or tables_id(src, dst) != tid:
        raise _bad("the table set's sides differ in length, or its id is not its digest")
    if any(s.page_bytes != d.page_bytes for s, d in zip(src, dst, strict=True)):
        raise _bad("source and destination pages differ in size")
    return agent_of(msg), tid, src, dst


def parse_write(msg: dict[str, Any]) -> WriteRequest:
    """A checked ``nixl_write`` (its page ids are checked against its table set by
    :func:`page_ids`, once the producer found the set)."""
    ttl = msg.get("ttl_s")
    if (
        not isinstance(ttl, float | int)
        or isinstance(ttl, bool)
        or not 0 < ttl <= MAX_TTL_S
        or not math.isfinite(ttl)
    ):
        raise _bad(f"ttl_s must be in (0, {MAX_TTL_S:.0f}]")
    base = (
        agent_of(msg),
        token_of(msg),
        _bytes(msg, "nonce", NONCE_BYTES, NONCE_BYTES),
        float(ttl),
    )
    if "ranges" in msg:
        raw = _bytes(msg, "ranges", MAX_RANGES * 24)
        if not raw or len(raw) % 24:
            raise _bad("ranges must hold rows of 3 uint64")
        rows = np.frombuffer(raw, dtype="<u8").reshape(-1, 3)
        if (rows[:, 2] == 0).any() or (rows[:, :2] > _U64 - 1 - rows[:, 2:3]).any():
            raise _bad("a range is empty or runs past the address space")
        by_dst = rows[np.argsort(rows[:, 0], kind="stable")]
        if (by_dst[1:, 0] < by_dst[:-1, 0] + by_dst[:-1, 2]).any():
            raise _bad("two ranges overlap in the destination")
        return WriteRequest(*base, None, rows)
    tid = _bytes(msg, "tables", 16, 16)
    groups = msg.get("groups")
    if not isinstance(groups, list) or len(groups) != 1:
        raise _bad("groups must be one [layers, pairs] group")
    group = groups[0]
    if not isinstance(group, list) or len(group) != 2:
        raise _bad("a group is [int32 layers, int32 pairs]")
    layers_raw = _blob(group[0], "layers", MAX_TABLES * 4)
    pairs_raw = _blob(group[1], "pairs", MAX_PAIRS * 8)
    if len(layers_raw) % 4 or len(pairs_raw) % 8 or not pairs_raw or not layers_raw:
        raise _bad("a group is [int32 layers, int32 pairs], neither empty")
    layers = np.frombuffer(layers_raw, dtype="<i4").astype(np.int64)
    pairs = np.frombuffer(pairs_raw, dtype="<i4").astype(np.int64).reshape(-1, 2)
    if len(np.unique(layers)) != len(layers) or len(np.unique(pairs[:, 1])) != len(pairs):
        raise _bad("a layer, or a destination page, appears twice in a group")
    return WriteRequest(*base, PageGroup(tid, layers, pairs), None)


def page_ids(
    g: PageGroup, src: tuple[PageTable, ...], dst: tuple[PageTable, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """The group's ``(source ids, destination ids)`` in its table set, every index checked."""
    layers, pairs = g.layers, g.pairs
    if layers.min() < 0 or layers.max() >= len(src):
        raise _bad("a layer is outside the table set")
    if pairs.min() < 0:
        raise _bad("a page id is negative")
    s_max = min(src[i].count for i in layers.tolist())
    d_max = min(dst[i].count for i in layers.tolist())
    if pairs[:, 0].max() >= s_max or pairs[:, 1].max() >= d_max:
        raise _bad("a page id is past its table")
    group: tuple[Group, ...] = ((layers, pairs),)
    s_ids, d_ids = group_ids(src, dst, group)
    if max(int(s_ids.max()), int(d_ids.max())) > MAX_INDEX:
        raise _bad(f"a page index past {MAX_INDEX} (writes are posted by int32 index)")
    return s_ids, d_ids
