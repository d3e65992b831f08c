"""What one shared-memory namespace holds: payloads, segments, caches, holds, orphans.

:func:`inventory` reads the namespace's files in the shared-memory directory
(``OMNIKV_SHM_DIR``, default ``/dev/shm``) once, without creating, locking or changing
any of them. Files come and go while it reads (a reader claims an entry, a producer
withdraws one): a file that vanishes is left out; every file is opened without
following a link or blocking on a FIFO and checked with ``fstat`` before a byte of it
is read, and one that is not a regular file of this user is counted as ``foreign``
and not read. What a file is comes from :func:`~vllm_omni_kv.backends.shm.arena.file_kind`;
whether its owner is gone from :func:`~vllm_omni_kv.backends.shm.arena.sweepable`.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field

import msgpack

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.entry_files import read_owned_fd
from vllm_omni_kv.errors import KVPayloadError

__all__ = ["SEGMENT_STATES", "ShmInventory", "inventory", "shm_inventory"]

#: payload segment states by header word 0 (``unknown``: no complete header)
SEGMENT_STATES = {
    arena.FREE: "free",
    arena.PUBLISHED: "published",
    arena.ONESHOT: "oneshot",
    arena.STREAMING: "streaming",
    arena.ABORTED: "aborted",
}


def _no_states() -> dict[str, int]:
    return {name: 0 for name in (*SEGMENT_STATES.values(), "unknown")}


@dataclass(frozen=True)
class ShmInventory:
    """The files of one shared-memory namespace, by what they are (counts and bytes).

    ``payloads``/``payload_bytes``: index entries published and not claimed yet, and
    the frame bytes they publish (inline or in a segment). ``segments``/``segment_bytes``:
    payload segments (header included); ``segments_free`` of them are FREE (in their
    producer's pool, ready for its next payload), ``segments_in_use`` are not (published,
    being written, held by the reader that claimed it, one-off, aborted, or no complete
    header), ``segment_states`` counts them by state. ``caches``/``cache_bytes``: segments
    of exported caches (a host KV cache with its 4 KiB header page, or the heartbeat
    segment of a CUDA IPC cache). ``holds``: hold files on shared cache pages (one per
    payload whose pages a consumer has not copied yet). ``transient``: index entries
    being written or claimed at that instant. ``orphans``: files whose owner is gone
    (what :func:`~vllm_omni_kv.backends.shm.arena.sweep_orphans` removes). ``foreign``:
    files named like this namespace's that are no regular files of this user (not read).
    ``files``/``bytes``: every file of the namespace.
    """

    namespace: str
    directory: str
    payloads: int = 0
    payload_bytes: int = 0
    segments: int = 0
    segments_free: int = 0
    segments_in_use: int = 0
    segment_bytes: int = 0
    segment_states: dict[str, int] = field(default_factory=_no_states)
    caches: int = 0
    cache_bytes: int = 0
    holds: int = 0
    transient: int = 0
    orphans: int = 0
    foreign: int = 0
    files: int = 0
    bytes: int = 0

    def table(self) -> str:
        """The inventory as a human-readable table."""
        used = ", ".join(f"{k} {v}" for k, v in self.segment_states.items() if v and k != "free")
        rows = [
            ("payloads published, not claimed", self.payloads, self.payload_bytes, ""),
            ("payload segments", self.segments, self.segment_bytes,
             f"free {self.segments_free}, in use {self.segments_in_use}"
             + (f" ({used})" if used else "")),
            ("exported caches", self.caches, self.cache_bytes, ""),
            ("holds on shared cache pages", self.holds, None, ""),
            ("index entries being written or claimed", self.transient, None, ""),
            ("orphans (vllm-omni-kv sweep removes them)", self.orphans, None, ""),
            ("foreign files (not read)", self.foreign, None, ""),
            ("files", self.files, self.bytes, ""),
        ]  # fmt: skip
        lines = [f"shared-memory namespace {self.namespace!r} in {self.directory}"]
        for what, count, nbytes, note in rows:
            size = "" if nbytes is None else f"{nbytes / 2**20:10.1f} MiB"
            lines.append(f"  {what:42s} {count:6d} {size:14s} {note}".rstrip())
        return "\n".join(lines)


def _read(name: str) -> tuple[str, int, str | int] | None:
    """``(kind, size, detail)`` of arena file ``name``: ``detail`` is a segment's state
    name or an entry's frame bytes; ``kind`` is ``foreign`` for a file not to be read.
    None when the file is gone."""
    try:
        fd = os.open(arena.path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), or no permission
        return "foreign", 0, 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return "foreign", 0, 0
        kind = arena.file_kind(name)
        detail: str | int = 0
        if kind == "segment":
            words = arena.header_of(fd)
            detail = "unknown" if words is None else SEGMENT_STATES.get(words[0], "unknown")
        elif kind == "index":
            try:
                detail = arena.entry_frame_bytes(read_owned_fd(fd, name, arena.MAX_INDEX_BYTES))
            except (KVPayloadError, ValueError, KeyError, TypeError, msgpack.UnpackException):
                detail = 0  # being replaced, or not recognisably ours: no bytes to count
        return kind, st.st_size, detail
    finally:
        os.close(fd)


def _orphaned(name: str, stale_s: float) -> bool:
    try:
        return arena.sweepable(name, stale_s)
    except OSError:  # gone meanwhile, or unreadable: nothing the sweep would remove
        return False


def inventory(namespace: str, stale_s: float = arena.STALE_S) -> ShmInventory:
    """The files of ``namespace`` now; ``stale_s``: the heartbeat age after which an owner
    in another PID namespace counts as gone (the backend's ``heartbeat_stale_s``; one in
    ours is judged by its pid, see :mod:`~vllm_omni_kv.backends.shm.liveness`)."""
    n: Counter[str] = Counter()
    states = _no_states()
    for name in sorted(arena.namespace_files(namespace)):
        got = _read(name)
        if got is None:
            continue
        kind, size, detail = got
        n["files"] += 1
        n["bytes"] += size
        n[kind] += 1
        n[kind + "_bytes"] += size
        if kind == "segment":
            states[str(detail)] += 1
        elif kind == "index":
            n["payload_bytes"] += int(detail)
        if kind != "foreign" and _orphaned(name, stale_s):
            n["orphans"] += 1
    return ShmInventory(
        namespace=namespace,
        directory=arena.SHM_DIR,
        payloads=n["index"],
        payload_bytes=n["payload_bytes"],
        segments=n["segment"],
        segments_free=states["free"],
        segments_in_use=n["segment"] - states["free"],
        segment_bytes=n["segment_bytes"],
        segment_states=states,
        caches=n["cache"],
        cache_bytes=n["cache_bytes"],
        holds=n["hold"],
        transient=n["transient"],
        orphans=n["orphans"],
        foreign=n["foreign"],
        files=n["files"],
        bytes=n["bytes"],
    )


#: the name the package exports (``vllm_omni_kv.shm_inventory``)
shm_inventory = inventory
