"""``MooncakeStoreConnector``: omni connector over Mooncake's distributed KV store.

Objects travel as packed frames (:mod:`vllm_omni_kv.wire.codec`). Each
connector registers a staging buffer of ``localbuf`` bytes with the store
(``register_buffer``): ``put`` packs the frame straight into a block of it and
calls ``put_from`` (the store copies it into a segment with its transfer
engine), ``open_stream`` asks ``get_size`` then ``get_into`` a block (the whole
object arrives; ``moved`` is its size) and returns a stream whose tensors are
zero-copy views; header and trailer are verified at once, each chunk when a
``load`` asks for it (the block is returned when the last view is dropped).
Frames larger than a free staging block fall back to ``put``/``get`` of bytes.
``discard`` removes a key without reading it.

Config keys (reference names and loopback defaults): ``host`` ("127.0.0.1"),
``metadata_server`` ("http://127.0.0.1:8080/metadata", or "P2PHANDSHAKE"),
``master`` ("127.0.0.1:50051"), ``proto`` ("tcp" | "rdma"), ``rdma`` (RDMA
device list, ""), ``segment`` (bytes this client contributes to the store,
512 MiB), ``localbuf`` (staging bytes, 64 MiB); plus ``remove_on_get`` (True:
one reader per key; False: keys stay until ``cleanup`` so several readers can
get them), ``get_timeout_s`` (how long ``get`` waits for a key to appear, 0),
``replica_num`` (store replicas per object, default: the store's),
``connect_timeout_s`` (how long the start waits for the master, and an HTTP
metadata server, to accept a TCP connection; 10).

Master down at start: the connector refuses to start (``KVTransferError`` naming
the master address) after ``connect_timeout_s`` instead of the store client's
own ~90 s of retries, so the engine fails at start rather than recomputing
every request. Master lost mid-run (killed: ``RPC_FAIL``; paused or wedged: the
call blocks for the store client's RPC timeout, ``MC_RPC_TIMEOUT_MS``, then
``RPC_TIMEOUT``): from the first such call on, puts, gets, removes and
``discard`` fail at once (puts and gets with ``KVTransferError`` naming the
master; the consumer keeps polling until its ``recv_timeout``, then vLLM
recomputes) until a background probe (:mod:`.probe`) gets an answer; keys whose
cleanup was skipped meanwhile are removed then. ``health()`` reports
"unhealthy" from the last store call and never blocks on the master. A
restarted master is picked up by the store client (keys stored before the
restart are gone).
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from typing import Any, ClassVar

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.keys import edge_key, is_request_key
from vllm_omni_kv.backends.mooncake_store.probe import (
    MASTER_DOWN,
    OBJECT_NOT_FOUND,
    MasterProbe,
)
from vllm_omni_kv.backends.mooncake_store.reach import check_reachable
from vllm_omni_kv.backends.pool import ManagedBuffer, MemoryPool
from vllm_omni_kv.backends.stats import COMMON, Counters
from vllm_omni_kv.errors import BackendUnavailable, ConfigError, KVTransferError
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.payload import KVCacheTransferData
from vllm_omni_kv.wire.stream import ArrivedFrameStream, PayloadStream

logger = init_logger(__name__)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (CPU-only hosts) or "
    "pip install mooncake-transfer-engine (CUDA hosts)"
)


def _import_store() -> Any:
    try:
        import mooncake.store as store_mod
    except ImportError as e:
        raise BackendUnavailable(
            f"the Mooncake store is not importable ({e}); install it with: {INSTALL_HINT}"
        ) from e
    return store_mod


def _as_frame(data: Any) -> codec.Frame:
    if isinstance(data, codec.Frame):
        return data
    if isinstance(data, KVCacheTransferData):
        return data.frame()
    if isinstance(data, ManagedBuffer):
        return codec.encode(data.tensor)
    return codec.encode(data)


class MooncakeStoreConnector(OmniConnectorBase):
    """Mooncake-store-backed omni connector (put/get by key through the store's master)."""

    TRANSPORT: ClassVar[str] = "mooncake_store"
    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset(
        "host metadata_server master proto rdma segment localbuf get_timeout_s "
        "connect_timeout_s remove_on_get replica_num".split()
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._closed = True  # until fully constructed
        self.config = dict(config or {})
        cfg = self.config
        self.host = str(cfg.get("host", "127.0.0.1"))
        self.metadata = str(cfg.get("metadata_server", "http://127.0.0.1:8080/metadata"))
        self.master = str(cfg.get("master", "127.0.0.1:50051"))
        self.proto = str(cfg.get("proto", "tcp"))
        self.rdma = str(cfg.get("rdma", ""))
        try:
            self.segment = int(cfg.get("segment", 512 * 1024 * 1024))
            self.localbuf = int(cfg.get("localbuf", 64 * 1024 * 1024))
            self.get_timeout_s = float(cfg.get("get_timeout_s", 0.0))
            self.connect_timeout_s = float(cfg.get("connect_timeout_s", 10.0))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"MooncakeStoreConnector: bad numeric setting: {e}") from None
        if self.segment <= 0 or self.localbuf <= 0:
            raise ConfigError("MooncakeStoreConnector: segment and localbuf must be > 0 bytes")
        self.remove_on_get = bool(cfg.get("remove_on_get", True))
        store_mod = _import_store()
        self.pin: Any = None
        if cfg.get("replica_num") is not None:
            self.pin = store_mod.ReplicateConfig()
            self.pin.replica_num = int(cfg["replica_num"])
        check_reachable(self.master, self.metadata, self.connect_timeout_s)
        self.store: Any = store_mod.MooncakeDistributedStore()
        ret = self.store.setup(
            self.host,
            self.metadata,
            self.segment,
            self.localbuf,
            self.proto,
            self.rdma,
            self.master,
        )
        if ret != 0:
            self.store = None
            raise KVTransferError(
                f"MooncakeDistributedStore.setup failed with code {ret}: is mooncake_master "
                f"running at {self.master} and the metadata server at {self.metadata} reachable? "
                "(start one with: mooncake_master -enable_http_metadata_server=true)"
            )
        self._staging = MemoryPool(self.localbuf, "cpu")
        if self.store.register_buffer(self._staging.base_ptr, self._staging.size) != 0:
            logger.warning("register_buffer of the staging area failed; using the copy path")
            self._staging_ok = False
        else:
            self._staging_ok = True
        self._lock = threading.Lock()
        self._keys: set[str] = set()  # keys this connector put and has not removed
        self._stats = Counters(*COMMON, "store_errors")
        #: the last failed store call (master unreachable...); "" once one succeeds
        self._last_error = ""
        #: set while the master is down: calls fail at once, a thread probes it
        self._probe = MasterProbe(self._master_up)
        self._down = self._probe.down
        #: keys whose removal was skipped while the master was down (removed when it is up)
        self._stale: set[str] = set()
        self._closed = False

    def _store_failed(self, op: str, key: str, code: int) -> KVTransferError:
        """Record a failed store call; the error to raise (names the master on RPC failure)."""
        self._stats.add("store_errors")
        if code in MASTER_DOWN:
            why = f"the Mooncake master at {self.master} is unreachable ({MASTER_DOWN[code]})"
            self._mark_down(code)
        else:
            why = f"the Mooncake store answered code {code}"
        self._last_error = f"{op} {key!r}: {why}"
        return KVTransferError(f"Mooncake store {self._last_error}")

    def _mark_down(self, code: int) -> None:
        """The master stopped answering: until the probe reaches it again, store calls fail
        at once instead of each blocking for the store client's RPC timeout (seconds,
        on the engine's step for puts and cleanups). Logged once per outage."""
        if self._closed or not self._probe.mark_down(self.store, code):
            return
        logger.warning(
            "the Mooncake master at %s is unreachable (%s): KV transfers fail (and vLLM "
            "recomputes) until it answers again",
            self.master,
            self._probe.reason,
        )

    def _check_up(self, op: str, key: str) -> None:
        if self._down.is_set():
            self._stats.add("store_errors")
            raise KVTransferError(
                f"Mooncake store {op} {key!r}: the Mooncake master at {self.master} is "
                f"unreachable ({self._probe.reason}; probing it in the background)"
            )

    def _store_ok(self) -> None:
        if self._last_error:
            logger.info("Mooncake store at %s answers again", self.master)
            self._last_error = ""

    def _master_up(self) -> None:
        """The probe got an answer: report it, remove the keys cleanups skipped meanwhile."""
        self._store_ok()
        with self._lock:
            stale, self._stale = list(self._stale), set()
        for k in stale:
            self._remove(k)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("MooncakeStoreConnector is closed; create a new connector")

    def _staging_block(self, size: int) -> ManagedBuffer | None:
        if not self._staging_ok:
            return None
        try:
            return self._staging.alloc(size)
        except KVTransferError:
            return None

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Store ``data`` under ``put_key``; ``(False, 0, None)`` when the store refuses it."""
        self._check_open()
        key = edge_key(put_key, from_stage, to_stage)
        self._check_up("put of", key)
        frame = _as_frame(data)
        size = frame.nbytes
        block = self._staging_block(size)
        if block is not None:
            with block:
                frame.pack_into(block.tensor.numpy())
                ret = self.store.put_from(key, block.address, size, *self._pin_args())
        else:
            ret = self.store.put(key, memoryview(frame.to_bytearray()), *self._pin_args())
        if ret != 0:
            logger.error("%s (%d bytes)", self._store_failed("put of", key, ret), size)
            return False, 0, None
        self._store_ok()
        with self._lock:
            self._keys.add(key)
        self._stats.add("puts")
        self._stats.add("bytes_put", size)
        return True, size, {"key": key, "data_size": size}

    def _pin_args(self) -> tuple[Any, ...]:
        return () if self.pin is None else (self.pin,)

    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Fetch the whole object; None when the key is not there (after ``get_timeout_s``)."""
        self._check_open()
        key = edge_key(get_key, from_stage, to_stage)
        self._check_up("get of", key)
        deadline = time.monotonic() + self.get_timeout_s
        size = self._get_size(key)
        while size < 0 and time.monotonic() < deadline:
            time.sleep(0.01)
            size = self._get_size(key)
        stream = self._read(key, size) if size > 0 else None
        if stream is None:
            self._stats.add("misses")
            return None
        if self.remove_on_get:
            self._remove(key)
        self._stats.add("gets")
        self._stats.add("bytes_got", size)
        return stream

    def _get_size(self, key: str) -> int:
        """The object's size, or -1 while it is not there; raises when the store fails."""
        size = int(self.store.get_size(key))
        if size < 0 and size != OBJECT_NOT_FOUND:
            raise self._store_failed("get_size of", key, size)
        self._store_ok()
        return size

    def discard(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None = None
    ) -> bool:
        """Remove ``key`` from the store without reading it; True when it was there."""
        self._check_open()
        bkey = edge_key(key, from_stage, to_stage)
        if self._down.is_set():
            return False
        there = int(self.store.is_exist(bkey))
        if there in MASTER_DOWN:
            logger.warning("%s", self._store_failed("is_exist of", bkey, there))
        if there != 1:
            return False
        self._remove(bkey)
        return True

    def _read(self, key: str, size: int) -> PayloadStream | None:
        block = self._staging_block(size)
        if block is None:
            raw = self.store.get(key)
            return ArrivedFrameStream(raw) if raw else None
        got = self.store.get_into(key, block.address, size)
        if got != size:
            block.release()
            if got in MASTER_DOWN:
                raise self._store_failed("get_into of", key, got)
            if got < 0:
                return None  # removed between get_size and get_into
            raise KVTransferError(f"Mooncake store get_into {key!r}: read {got} of {size} bytes")
        view = (ctypes.c_char * size).from_address(block.address)
        weakref.finalize(view, block.release)  # tensors are views: free with the last one
        return ArrivedFrameStream(view)

    def _remove(self, key: str) -> None:
        """Remove ``key``; while the master is down, note it for removal once it is up."""
        store = self.store
        if self._closed or store is None:
            return
        if not self._down.is_set():
            ret = int(store.remove(key, True))
            if ret not in MASTER_DOWN:
                if ret != 0 and store.is_exist(key) == 1:
                    logger.warning("Mooncake store remove of %r failed with code %d", key, ret)
                with self._lock:
                    self._keys.discard(key)
                return
            logger.warning("%s", self._store_failed("remove of", key, ret))
        with self._lock:
            if key in self._keys:
                self._stale.add(key)

    def cleanup(self, request_id: str) -> None:
        """Remove every key this connector put for ``request_id`` (any edge)."""
        if self._closed:
            return
        with self._lock:
            keys = [k for k in self._keys if is_request_key(k, request_id)]
        for k in keys:
            self._remove(k)

    def close(self) -> None:
        """Remove this connector's keys, unregister the staging buffer, close the store."""
        if self._closed:
            return
        self._closed = True
        store, self.store = self.store, None
        if store is None:
            return
        with self._lock:
            keys, self._keys, self._stale = list(self._keys), set(), set()
        if self._down.is_set():
            keys = []  # each call would block for the RPC timeout

        def finish() -> None:
            self._close_store(store, keys)

        handed = not self._probe.stop(finish)  # the probe closes it after its call
        if not handed and not self._down.is_set():
            finish()
            return
        if not handed:
            threading.Thread(target=finish, name="omnikv-mooncake-close", daemon=True).start()
        logger.info(
            "the Mooncake master at %s is down: its client closes in the background", self.master
        )

    def _close_store(self, store: Any, keys: list[str]) -> None:
        for k in keys:
            if int(store.remove(k, True)) in MASTER_DOWN:
                break  # the master stopped answering: so would the next calls
        if self._staging_ok:
            store.unregister_buffer(self._staging.base_ptr)
        store.close()

    def health(self) -> dict[str, Any]:
        stats = self._stats.snapshot()
        with self._lock:
            pending = len(self._keys)
        # from the last store call: the store's own health_check blocks for seconds on a
        # lost master, and the connector's stats ask for health on the engine's step
        if self._closed or self.store is None:
            status = "closed"
        else:
            status = "unhealthy" if self._last_error else "healthy"
        return {
            "status": status,
            "last_error": self._last_error,
            "backend": "mooncake_store",
            "master": self.master,
            "metadata_server": self.metadata,
            "proto": self.proto,
            "pending_keys": pending,
            **stats,
        }


MooncakeConnector = MooncakeStoreConnector


def selftest() -> dict[str, Any]:
    """Start a loopback master, round-trip a tensor and a dict through two clients."""
    try:
        import torch

        from vllm_omni_kv.backends.mooncake_store.master import mooncake_master

        with mooncake_master() as m:
            a = MooncakeStoreConnector(m.store_config())
            b = MooncakeStoreConnector(m.store_config())
            try:
                t = torch.arange(4096, dtype=torch.float32)
                ok, size, _ = a.put("0", "1", "selftest", {"t": t, "s": "hi"})
                got = b.get("0", "1", "selftest")
                if not ok or got is None:
                    return {"ok": False, "detail": "store round trip returned nothing"}
                if not (torch.equal(got[0]["t"], t) and got[0]["s"] == "hi"):
                    return {"ok": False, "detail": "store round trip returned different data"}
                return {"ok": True, "detail": f"loopback master {m.master_address}: {size} B"}
            finally:
                a.close()
                b.close()
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}
