"""``SharedMemoryConnector``: key-addressed POSIX shared memory on one host.

Data path: the producer packs the frame straight into a pre-faulted segment of
its arena (the only copy on its side) and publishes a small index entry under
a name derived from the key; ``get`` claims the entry (exactly one reader
wins) and returns the decoded object whose tensors are views of the
producer's segment (no copy on the reader's side). The segment goes back to
the producer when the last view is garbage collected. See
:mod:`vllm_omni_kv.backends.shm.arena` for the file layout (the producer's side)
and :mod:`vllm_omni_kv.backends.shm.reader` for the reader's. Linux only.

Streaming (``stream``, default on x86-64): the entry is published as soon as
the frame's header is written; ``get`` still waits for the whole frame, while
``open_stream`` hands it over at once and lets the reader copy each packed step
out while the producer writes the next. A stream's ``load(spans)`` reads and
verifies only the chunks covering ``spans``; ``discard`` frees an entry without
reading its payload.

A segment owner in our PID namespace is alive while its pid runs with the start time its
header records; across containers (separate PID namespaces sharing ``/dev/shm``) its
heartbeat tells, and a reader that dies after claiming a segment loses it once its lease
goes stale (both after ``heartbeat_stale_s``; see :mod:`vllm_omni_kv.backends.shm.liveness`).
A waiting consumer extends an unconsumed entry's lease with :meth:`SharedMemoryConnector.extend`: it moves the index entry's
modification time into the future, which the producer reads in ``held_until``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from typing import Any, ClassVar

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.backends.keys import key_of_request
from vllm_omni_kv.backends.shm import arena, producer, reader
from vllm_omni_kv.backends.shm.cache_region import ShmCacheRegion
from vllm_omni_kv.backends.stats import COMMON, Counters
from vllm_omni_kv.errors import BackendUnavailable, ConfigError, KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.stream import PayloadStream

logger = init_logger(__name__)


def index_name(namespace: str, from_stage: str, to_stage: str, key: str) -> str:
    """The index-entry name for ``key`` on the edge ``from_stage -> to_stage``."""
    ident = "\0".join((namespace, str(from_stage), str(to_stage), str(key)))
    digest = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return f"{arena.IDX_PREFIX}{arena.namespace_tag(namespace)}_{digest}"


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"SharedMemoryConnector: {name} must be true or false, got {value!r}")


def _ordered_stores() -> bool:
    """True on CPUs whose stores become visible to other cores in program order."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class SharedMemoryConnector(OmniConnectorBase):
    """Key-addressed local shared-memory connector.

    Config keys (all optional): ``shm_threshold_bytes`` (payloads smaller than
    this skip the arena and travel inside the index entry and the returned
    metadata; default 65536), ``namespace`` (isolates deployments sharing a
    host; default ``"default"``), ``pool_max_bytes`` (arena size a producer may
    keep mapped; larger payloads use one-off segments; default 1 GiB),
    ``ttl_seconds`` (an unconsumed entry older than this is removed by its
    producer; default 600), ``verify`` (check checksums on get; default True),
    ``stream`` (publish entries before they are fully written so that
    ``open_stream`` readers overlap their copy with the producer's; default
    true on x86-64, whose store ordering the protocol relies on),
    ``heartbeat_stale_s`` (a heartbeat of a producer in another PID namespace, or a
    reader lease, older than this counts as dead; default 120, at least 3),
    ``share_cache`` (allocate the producer's host KV cache in shared memory and send block
    ids instead of bytes, so a consumer copies its pages once, cache to cache; default
    true: measured at 121% of a memcpy against 39% for packed frames at 64 MiB in
    ``benchmarks/one_copy_bench.py``; a cache that cannot be placed there, e.g. a small ``/dev/shm``, falls back to packed payloads; see
    :mod:`vllm_omni_kv.backends.shm.cache_region`), ``verify_pages`` (with ``share_cache``
    on a host cache: a digest per page, verified by consumers after copying; default
    false), ``populate`` (map arena segments pre-faulted, ``MAP_POPULATE``; default true).
    Remote-transport metadata (``source_host``...) is ignored: lookups are by key.
    """

    TRANSPORT: ClassVar[str] = "shm"
    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset(
        "shm_threshold_bytes namespace pool_max_bytes ttl_seconds verify stream populate "
        "heartbeat_stale_s share_cache verify_pages".split()
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._closed = True  # until fully constructed
        self.config = dict(config or {})
        if not os.path.isdir(arena.SHM_DIR):
            raise BackendUnavailable(
                f"SharedMemoryConnector needs POSIX shared memory at {arena.SHM_DIR} (Linux); "
                "use a network backend (mooncake) on this platform"
            )
        try:
            self.threshold = int(self.config.get("shm_threshold_bytes", 65536))
            self.ttl = float(self.config.get("ttl_seconds", 600.0))
            pool_max = int(self.config.get("pool_max_bytes", 1 << 30))
            self.stale_s = float(self.config.get("heartbeat_stale_s", arena.STALE_S))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"SharedMemoryConnector: bad numeric setting: {e}") from None
        if not 0 <= self.threshold <= arena.MAX_INDEX_BYTES or self.ttl <= 0 or pool_max < 0:
            raise ConfigError(
                "SharedMemoryConnector: shm_threshold_bytes must be within "
                f"[0, {arena.MAX_INDEX_BYTES}], pool_max_bytes >= 0 and ttl_seconds > 0"
            )
        if not self.stale_s >= 3 * arena.HEARTBEAT_S:
            raise ConfigError(
                f"SharedMemoryConnector: heartbeat_stale_s must be at least "
                f"{3 * arena.HEARTBEAT_S:g} seconds (heartbeats are written every "
                f"{arena.HEARTBEAT_S:g}s), got {self.stale_s!r}"
            )
        self.namespace = str(self.config.get("namespace", "default"))
        self.verify = bool(self.config.get("verify", True))
        self.stream = bool(self.config.get("stream", _ordered_stores()))
        if self.stream and not _ordered_stores():
            logger.warning(
                "SharedMemoryConnector: stream=true on %s, whose CPU may reorder stores: "
                "readers can see a checksum mismatch (never wrong data); set stream=false",
                platform.machine(),
            )
        self.supports_streaming = self.stream
        self._arena = producer.ProducerArena(
            pool_max,
            populate=bool(self.config.get("populate", True)),
            namespace=self.namespace,
            stale_s=self.stale_s,
        )
        self._maps = reader.ConsumerMaps(stale_s=self.stale_s)
        if _flag(self.config.get("share_cache", True), "share_cache"):
            self.cache_region = self._make_region()
            pages = _flag(self.config.get("verify_pages", False), "verify_pages")
            self.cache_region.digests = pages and self.cache_region.kind == "shm"  # host only
        self._lock = threading.Lock()
        # index entries this process published and nobody claimed yet: name -> (key, time)
        self._owned: dict[str, tuple[str, float, int]] = {}  # name -> (key, put at, bytes)
        self._last_sweep = 0.0
        self._stats = Counters(*COMMON)
        swept = arena.sweep_orphans(self.stale_s)
        if swept:
            logger.info("removed %d shared-memory files left by exited processes", len(swept))
        self._closed = False

    def _make_region(self) -> CacheRegion:
        return ShmCacheRegion(self.namespace, self._arena, self.stale_s)

    # -- producer ----------------------------------------------------------------------
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Publish ``data`` under ``put_key``; returns ``(True, size, metadata)``."""
        self._check_open()
        self._expire_old()
        name = index_name(self.namespace, from_stage, to_stage, put_key)
        if os.path.exists(os.path.join(arena.SHM_DIR, name)):
            raise KVTransferError(
                f"key {put_key!r} on edge {from_stage}->{to_stage} is already published and "
                "unconsumed; use a unique key per transfer or cleanup() the old one"
            )
        try:
            size, inline = producer.publish(
                self._arena, name, codec.encode(data), self.threshold, stream=self.stream
            )
        except BaseException:
            self._discard(name)  # a streamed entry may already be visible: withdraw it
            raise
        with self._lock:
            self._owned[name] = (put_key, time.monotonic(), size)
        self._stats.add("puts")
        self._stats.add("bytes_put", size)
        meta: dict[str, Any] = {"key": put_key, "size": size}
        if inline is not None:
            meta["inline"] = inline
        return True, size, meta

    # -- consumer ----------------------------------------------------------------------
    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """Claim and decode the entry for ``get_key``; None when it is not there (yet).

        Raises ``KVPayloadError`` when the payload is corrupt and
        ``KVTransferError`` when its producer vanished: a retry cannot succeed.
        """
        self._check_open()
        name = index_name(self.namespace, from_stage, to_stage, get_key)
        entry = self._claim(name, complete=True)
        if entry is None:
            return None
        obj, size = reader.read_entry(entry, self._maps, verify=self.verify)
        self._count_get(size)
        return obj, size

    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Claim the entry for ``get_key`` even while its producer is still writing it."""
        self._check_open()
        name = index_name(self.namespace, from_stage, to_stage, get_key)
        entry = self._claim(name, complete=False)
        if entry is None:
            return None
        stream = reader.open_entry_stream(entry, self._maps, verify=self.verify)
        self._count_get(stream.size)
        return stream

    def discard(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Claim the entry for ``key`` and hand its segment back unread; True when it was there."""
        self._check_open()
        name = index_name(self.namespace, from_stage, to_stage, key)
        found = self._discard(name)
        if not found:
            self._stats.add("misses")
        return found

    def extend(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        seconds: float,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Ask the producer to keep the unconsumed entry for ``key`` ``seconds`` longer
        (from now); False when it is not there. The producer caps it at its ``ttl_seconds``."""
        self._check_open()
        name = index_name(self.namespace, from_stage, to_stage, key)
        until = time.time() + max(0.0, float(seconds))
        try:
            st = os.lstat(os.path.join(arena.SHM_DIR, name))
            if until > st.st_mtime:
                os.utime(os.path.join(arena.SHM_DIR, name), (st.st_atime, until))
        except (FileNotFoundError, PermissionError):
            return False
        return True

    def held_until(self, from_stage: str, to_stage: str, key: str) -> float | None:
        """Producer: None once ``key``'s entry is gone (claimed or withdrawn), else the
        ``time.monotonic()`` a consumer extended it to (``0.0``: never extended)."""
        return self._extended(index_name(self.namespace, from_stage, to_stage, key))

    def _extended(self, name: str) -> float | None:
        try:
            mtime = os.lstat(os.path.join(arena.SHM_DIR, name)).st_mtime
        except FileNotFoundError:
            return None
        ahead = min(mtime - time.time(), self.ttl)
        return time.monotonic() + ahead if ahead > 0 else 0.0

    def _claim(self, name: str, *, complete: bool) -> bytes | None:
        entry: bytes | None = None
        if complete:  # leave a streamed entry in place until its producer is done
            peeked = reader.peek_index(name)
            if peeked is not None and reader.entry_complete(peeked, self._maps):
                entry = arena.claim_index(name)
        else:
            entry = arena.claim_index(name)
        if entry is None:
            self._stats.add("misses")
        else:
            with self._lock:
                self._owned.pop(name, None)
        return entry

    def _count_get(self, size: int) -> None:
        self._stats.add("gets")
        self._stats.add("bytes_got", size)

    # -- lifecycle -----------------------------------------------------------------------
    def _expire_old(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        self._prune_claimed()
        with self._lock:
            old = [n for n, (_k, t, _n) in self._owned.items() if now - t > self.ttl]
        stale = [n for n in old if (self._extended(n) or 0.0) <= now]
        for n in stale:
            self._discard(n, reason=f"unconsumed after {self.ttl:.0f}s")

    def _discard(self, name: str, reason: str = "") -> bool:
        """Claim an entry and hand its segment back unread (a producer still writing it
        frees it when done); False when nobody published it or a reader got it first."""
        with self._lock:
            self._owned.pop(name, None)
        entry = arena.claim_index(name)
        if entry is None:
            return False
        if reason:
            logger.warning("withdrew shared-memory entry %s: %s", name, reason)
        try:
            ref = reader.parse_ref(entry)
            if ref is not None:
                reader.release_claimed(reader.map_segment(ref, self._maps), ref, self._maps)
        except Exception:  # corrupt, recycled, or its producer is gone: nothing left to free
            pass
        return True

    def cleanup(self, request_id: str) -> None:
        """Withdraw this process's unconsumed entries whose key is, starts or ends with ``request_id``."""
        with self._lock:
            names = [n for n, (k, _t, _n) in self._owned.items() if key_of_request(k, request_id)]
        for n in names:
            self._discard(n)

    def close(self) -> None:
        """Withdraw unconsumed entries and unlink the arena; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            names = list(self._owned)
            self._owned.clear()
        for n in names:
            arena.unlink_quiet(n)
        if self.cache_region is not None:
            self.cache_region.close()
        self._maps.close()
        self._arena.close()

    def _prune_claimed(self) -> None:
        """Forget entries a reader in another process has claimed since."""
        with self._lock:
            names = list(self._owned)
        gone = [n for n in names if not os.path.exists(os.path.join(arena.SHM_DIR, n))]
        with self._lock:
            for n in gone:
                self._owned.pop(n, None)

    def held_payloads(self) -> tuple[int, int]:
        self._prune_claimed()
        with self._lock:
            return len(self._owned), sum(n for _k, _t, n in self._owned.values())

    def health(self) -> dict[str, Any]:
        self._prune_claimed()
        stats = self._stats.snapshot()
        with self._lock:
            owned = len(self._owned)
            held_bytes = sum(n for _k, _t, n in self._owned.values())
        return {
            "status": "closed" if self._closed else "healthy",
            "backend": "shm",
            "namespace": self.namespace,
            "unconsumed": owned,
            "held_bytes": held_bytes,
            "arena_bytes": self._arena.total_bytes,
            "reclaimed": self._arena.reclaimed,
            "reader_leases": reader.LEASES.held(),
            **stats,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("SharedMemoryConnector is closed; create a new one")
