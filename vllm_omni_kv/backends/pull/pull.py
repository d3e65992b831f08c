"""Pull-based transfer-engine connector: the logic shared by Mooncake TE and Yuanrong TE.

Data path (sender -> receiver):

1. ``put`` places the payload in the sender's registered pool: a ``ManagedBuffer`` of that
   pool is exposed as is (zero copy), a tensor or bytes are copied once, any other object
   is laid out with :func:`codec.encode` and packed straight into the pool (one copy).
2. ``open_stream``: the receiver learns address, size and kind over the TCP
   side channel (``acquire`` grants a lease so the TTL sweeper cannot free the
   block mid-transfer), allocates a block of its own pool sized for the whole
   frame and pulls just prelude, header and digest trailer with the engine's
   synchronous read; ``load(spans)`` pulls only the chunks covering ``spans``
   (see :mod:`.pull_stream`). Every read is bounded by ``transfer_timeout_s``.
   Leases are held per receiver thread (see :mod:`.sender_requests`).
3. ``release`` tells the sender the pull finished (its reply confirms the block was
   live throughout); the block is freed after ``max_pulls`` releases (``0``: at
   ``cleanup``/TTL). ``discard`` acquires and releases without pulling.

Buffers never pulled are freed ``buffer_ttl_s`` after ``put``, or after the last
``extend`` of a waiting consumer (each by at most ``buffer_ttl_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid
from typing import Any, ClassVar

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.keys import edge_key, is_request_key
from vllm_omni_kv.backends.net import local_ip
from vllm_omni_kv.backends.pool import ManagedBuffer, MemoryPool
from vllm_omni_kv.backends.pull import pull_stream as ps
from vllm_omni_kv.backends.pull.exposure import ExposureTable
from vllm_omni_kv.backends.pull.pull_stream import Lease, LeaseBook, PullFrameStream, RawPullStream
from vllm_omni_kv.backends.pull.puller import EngineAdapter, Puller, PullFailed, register_memory
from vllm_omni_kv.backends.pull.sender_ops import SenderOps
from vllm_omni_kv.backends.pull.sender_requests import SenderEndpoints, SenderRequests
from vllm_omni_kv.backends.pull.side_channel import (
    MAX_RATE,
    PORT_KEYS,
    SideChannelServer,
    sender_zmq_port,
)
from vllm_omni_kv.backends.pull.staging import sized, stage_in_pool
from vllm_omni_kv.backends.stats import COMMON, Counters
from vllm_omni_kv.errors import ConfigError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import LogBudget, init_logger
from vllm_omni_kv.wire.auth import auth_of
from vllm_omni_kv.wire.stream import PayloadStream

logger = init_logger(__name__)
_per_peer = LogBudget(logger)  # lines a silent or hostile peer causes per request

ROLES = ("sender", "receiver", "dual")

__all__ = ["ROLES", "EngineAdapter", "PullTransferConnector"]


class PullTransferConnector(OmniConnectorBase):
    """Shared implementation; subclasses provide ``_make_engine``."""

    backend_name = "transfer-engine"
    CONFIG_KEYS: ClassVar[frozenset[str]] = PORT_KEYS | frozenset(
        "role host memory_pool_size memory_pool_device max_pulls buffer_ttl_s transfer_timeout_s "
        "side_channel_timeout_s get_timeout_s raise_on_timeout frame_checksum lease_slack_s "
        "sender_host sender_zmq_port auth_key_file side_channel_max_rate require_digests".split()
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._closed = True  # until fully constructed (``__del__`` safety)
        self.config = dict(config or {})
        lease_slack_s = self._read_settings(self.config)
        self.engine_id = uuid.uuid4().hex
        self._exposed = ExposureTable(self.buffer_ttl_s, self.max_pulls, lease_slack_s)
        self.leases = LeaseBook()  # the leases of this receiver's open streams
        self._stats = Counters(*COMMON, "timeouts", "failures")
        self._server: SideChannelServer | None = None
        self._client: SenderRequests | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        self.engine: EngineAdapter = self._make_engine()
        self._ops = SenderOps(
            self._exposed, self.engine, self.engine_id, self.transfer_timeout_s, self.buffer_ttl_s
        )
        try:
            pool = self.pool = MemoryPool(self.pool_size, self.pool_device)
            self.allocator = pool.allocator
            self.base_ptr = pool.base_ptr
            self._host_pool = pool.device.type == "cpu"
            register_memory(self.engine, self.backend_name, self.base_ptr, pool.size, pool.device)
        except BaseException:
            self.engine.close()
            raise
        self.rpc_port = int(self.engine.session.rsplit(":", 1)[1])
        try:
            self._start_side_channel()
        except BaseException:
            self._shutdown()
            raise
        self._closed = False

    def _read_settings(self, cfg: dict[str, Any]) -> float:
        """Role, host, numeric settings and the default sender; returns ``lease_slack_s``."""
        self.role = str(cfg.get("role", "sender"))
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        self.can_put = self.role in ("sender", "dual")
        self.can_get = self.role in ("receiver", "dual")
        host = str(cfg.get("host", "auto"))
        self.host = local_ip() if host.lower() in ("", "auto", "0.0.0.0") else host
        try:
            self.pool_size = int(cfg.get("memory_pool_size", 1024**3))
            self.max_pulls = int(cfg.get("max_pulls", 1))
            self.buffer_ttl_s = float(cfg.get("buffer_ttl_s", 300.0))
            self.transfer_timeout_s = float(cfg.get("transfer_timeout_s", 30.0))
            self.side_channel_timeout_s = float(cfg.get("side_channel_timeout_s", 5.0))
            self.max_rate = float(cfg.get("side_channel_max_rate", MAX_RATE))
            self.get_timeout_s = float(cfg.get("get_timeout_s", 0.0))
            self.raise_on_timeout = bool(cfg.get("raise_on_timeout", False))
            self.frame_checksum = bool(cfg.get("frame_checksum", True))
            lease_slack_s = float(cfg.get("lease_slack_s", 5.0))
            self.zmq_port = sender_zmq_port(cfg) if self.can_put else 0
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{type(self).__name__}: bad numeric setting: {e}") from None
        if min(self.max_pulls + 1, self.buffer_ttl_s, self.transfer_timeout_s, self.max_rate) <= 0:
            raise ConfigError(
                "max_pulls >= 0, buffer_ttl_s, transfer_timeout_s and side_channel_max_rate > 0 "
                "required"
            )
        self.auth = auth_of(cfg)  # side-channel MACs (frames are keyed by the session)
        self.pool_device = str(cfg.get("memory_pool_device", "cpu"))
        self._senders = SenderEndpoints(cfg.get("sender_host"), cfg.get("sender_zmq_port"))
        return lease_slack_s

    def _start_side_channel(self) -> None:
        """The sender's side-channel server (senders only), the receiver's client, the pulls."""
        if self.can_put:
            self._server = SideChannelServer(
                self.host,
                self.zmq_port,
                self._handle,
                on_idle=self._exposed.sweep,
                idle_interval_s=min(0.5, self.buffer_ttl_s / 4),
                auth=self.auth,
                max_rate=self.max_rate,
            )
            self.zmq_port = self._server.port
        self._client = SenderRequests(self.side_channel_timeout_s, self.engine_id, auth=self.auth)
        self._executor = cf.ThreadPoolExecutor(4, thread_name_prefix="omnikv-pull")
        self._puller = Puller(self.engine, self._executor, self.transfer_timeout_s)
        self._puller.require_digests = bool(self.config.get("require_digests", True))
        if not self._host_pool:  # pull threads read into device memory: bind its device
            self._puller.device = self.pool.tensor.device

    # -- subclass hook -------------------------------------------------------------
    def _make_engine(self) -> EngineAdapter:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"{type(self).__name__} is closed; create a new connector")

    # -- producer side ---------------------------------------------------------------
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Expose ``data`` for pulling; raises ``KVTransferError`` when the pool is full."""
        self._check_open()
        if not self.can_put:
            raise KVTransferError(
                f"this connector's role is {self.role!r}: it cannot put; use role 'sender' or 'dual'"
            )
        key = edge_key(put_key, from_stage, to_stage)
        buf, size, fast, dtype, shape = stage_in_pool(self.pool, data, checksum=self.frame_checksum)
        entry = self._exposed.add(key, buf, size, fast, dtype, shape, self._host_pool)
        self._stats.add("puts")
        self._stats.add("bytes_put", size)
        meta = {
            "source_host": self.host,
            "source_port": self.zmq_port,
            "data_size": size,
            "is_fast_path": fast,
            "src_addr": buf.address,
            "session": self.engine.session,
            "token": entry.token,
            "dtype": dtype,
            "shape": shape,
        }
        return True, size, meta

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one side-channel request (:class:`.sender_ops.SenderOps`); subclasses add ops."""
        return self._ops(msg)

    def held_until(self, from_stage: str, to_stage: str, key: str) -> float | None:
        """None once ``key`` is no longer exposed; else the deadline a consumer extended it to."""
        return self._exposed.held_until(edge_key(key, from_stage, to_stage))

    def retain(self, from_stage: str, to_stage: str, put_key: str, pulls: int = 1) -> bool:
        """Allow ``pulls`` more receivers to pull ``put_key`` (and restart its TTL)."""
        return self._exposed.retain(edge_key(put_key, from_stage, to_stage), pulls)

    def release(self, from_stage: str, to_stage: str, put_key: str) -> None:
        """Stop exposing ``put_key``; the block is freed once in-flight pulls finish."""
        self.cleanup(put_key, from_stage, to_stage)

    def cleanup(
        self, request_id: str, from_stage: str | None = None, to_stage: str | None = None
    ) -> None:
        """Free the producer-side blocks of ``request_id`` (every edge unless both stages given)."""
        if from_stage is not None and to_stage is not None:
            key = edge_key(request_id, from_stage, to_stage)
            self._exposed.retire_where(lambda k: k == key)
        else:
            self._exposed.retire_where(lambda k: is_request_key(k, request_id))

    # -- consumer side -----------------------------------------------------------------
    def update_sender_info(
        self, sender_host: str, sender_zmq_port: int, sender_rank: int | None = None
    ) -> None:
        """Set the default sender (``sender_rank=None``) or the endpoint of one sender rank."""
        self._senders.update(sender_host, sender_zmq_port, sender_rank)

    def _check_get(self) -> None:
        self._check_open()
        if not self.can_get:
            raise KVTransferError(
                f"this connector's role is {self.role!r}: it cannot get; use role 'receiver' or 'dual'"
            )

    def _locate(
        self, key: str, endpoint: str, metadata: dict[str, Any] | None
    ) -> tuple[dict[str, Any], str | None] | None:
        """The block's address, size and kind, plus a lease (unless ``metadata`` has them all).

        None when the key is not there (yet); side-channel timeouts are reported by
        :meth:`_timed_out`.
        """
        md = {k: v for k, v in (metadata or {}).items() if k not in ps.REPLY_ONLY}
        if all(md.get(k) is not None for k in ("data_size", "src_addr", "session", "token")):
            return md, None
        assert self._client is not None
        try:
            info = self._client.acquire(endpoint, key, self.transfer_timeout_s, self.get_timeout_s)
        except KVTransferTimeout as e:
            self._timed_out(e)
            return None
        if info is None:
            self._stats.add("misses")
            return None
        md.update(info)
        return md, info["lease"]

    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Lease ``get_key`` and pull its prelude, header and digest trailer; ``load`` pulls
        the chunks it needs. None when absent or after a bounded timeout (logged; raised
        with ``raise_on_timeout``). A raw buffer put on the fast path opens a stream whose
        ``obj`` is the receiving :class:`ManagedBuffer` (the caller releases it)."""
        self._check_get()
        key = edge_key(get_key, from_stage, to_stage)
        endpoint = self._senders.resolve(metadata)
        found = self._locate(key, endpoint, metadata)
        if found is None:
            return None
        md, lease_id = found
        lease = Lease(
            lambda ok: self._release_remote(endpoint, key, md.get("token", ""), lease_id, ok),
            self.leases,
            key,
        )
        try:
            size = ps.block_of(md)[0]  # before any allocation: the reply may be hostile
            local = self.pool.alloc(max(size, 1))
        except KVTransferError:
            lease.end(False)
            raise
        try:
            stream = self._pull_stream(key, md, local, lease)
        except KVTransferTimeout as e:
            self._timed_out(e)
            return None
        except PullFailed:
            self._stats.add("failures")
            raise
        self._stats.add("gets")
        self._stats.add("bytes_got", size)
        return stream

    def _pull_stream(
        self, key: str, md: dict[str, Any], local: ManagedBuffer, lease: Lease
    ) -> PayloadStream:
        """The stream pulling ``md``'s block (checked by ``block_of``) into ``local``: raw (fast
        path, device pool) or a frame whose chunks ``load`` pulls (or ``md``'s ``frame``)."""
        size, session, src = md["data_size"], str(md["session"]), md["src_addr"]
        fast, inline = bool(md.get("is_fast_path", True)), ps.inline_of(md, size)
        if fast or not self._host_pool:  # (a device pool's block is never written from bytes)
            stream = RawPullStream(
                self._puller, session, src, size, local, lease, what=repr(key), frame=not fast,
                inline=inline if self._host_pool else None)  # fmt: skip
            if fast:
                local = sized(local, size)
                local.dtype_name, local.shape = md.get("dtype"), md.get("shape")
            return stream
        deadline = time.monotonic() + self.transfer_timeout_s
        return PullFrameStream(
            self._puller, session, src, size, local, lease, what=repr(key), deadline=deadline,
            inline=inline, edges=ps.edges_of(md, size))  # fmt: skip

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Pull ``get_key``; ``(ManagedBuffer, size)`` for tensors/bytes (caller releases),
        ``(object, size)`` otherwise; None when absent or on a bounded failure."""
        try:
            stream = self.open_stream(from_stage, to_stage, get_key, metadata)
            if stream is None:
                return None
            with stream:
                for _ in stream.load(None, time.monotonic() + self.transfer_timeout_s):
                    pass
                return stream.obj, stream.size
        except KVTransferTimeout as e:
            self._timed_out(e)
            return None
        except PullFailed as e:
            self._stats.add("failures")
            logger.error("%s; returning None", e)
            return None

    def discard(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None = None
    ) -> bool:
        """Acquire and release ``key`` without pulling: the sender frees the block once its
        ``max_pulls`` releases are in. True when the key was there."""
        self._check_get()
        bkey = edge_key(key, from_stage, to_stage)
        endpoint = self._senders.resolve(metadata)
        found = self._locate(bkey, endpoint, metadata)
        if found is None:
            return False
        md, lease_id = found
        self._release_remote(endpoint, bkey, md.get("token", ""), lease_id, success=True)
        return True

    def extend(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        seconds: float,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Ask the sender to keep ``key`` ``seconds`` longer (it caps them at its
        ``buffer_ttl_s``); False when it is not there or the sender did not answer."""
        self._check_get()
        endpoint = self._senders.resolve(metadata)
        assert self._client is not None
        try:
            reply = self._client.extend(endpoint, edge_key(key, from_stage, to_stage), seconds)
        except KVTransferError as e:
            logger.debug("extending %r at %s: %s", key, endpoint, e)
            return False
        return bool(reply.get("ok"))

    def _timed_out(self, err: KVTransferTimeout) -> None:
        self._stats.add("timeouts")
        if self.raise_on_timeout:
            raise err
        _per_peer.error("%s; returning None", err)

    def _release_remote(
        self, endpoint: str, key: str, token: str, lease: str | None, success: bool
    ) -> bool:
        assert self._client is not None
        try:
            reply = self._client.release(endpoint, key, token, lease, success)
        except KVTransferError as e:
            _per_peer.warning("could not confirm pull of %r with its sender: %s", key, e)
            return False
        return bool(reply.get("ok"))

    # -- lifecycle / introspection -----------------------------------------------------
    def get_connection_info(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "zmq_port": self.zmq_port,
            "rpc_port": self.rpc_port,
            "session": self.engine.session,
            "engine_id": self.engine_id,
            "role": self.role,
            "backend": self.backend_name,
        }

    def side_channel_endpoint(self) -> tuple[str, int] | None:
        return (self.host, self.zmq_port) if self.can_put and self.zmq_port > 0 else None

    def held_payloads(self) -> tuple[int, int]:
        counts = self._exposed.counts()
        return int(counts.get("exposed_keys", 0)), int(counts.get("held_bytes", 0))

    def transport(self) -> str:
        """``<backend>:<engine path>`` (the engine's protocol, or its transports)."""
        path = getattr(self.engine, "transport", None)  # optional on an EngineAdapter
        return f"{self.backend_name}:{path()}" if path is not None else self.backend_name

    def health(self) -> dict[str, Any]:
        stats = self._stats.snapshot()
        out: dict[str, Any] = {
            "status": "closed" if self._closed else "healthy",
            "backend": self.backend_name,
            "transport": self.transport(),
            "role": self.role,
            **self._exposed.counts(),
            **stats,
            **self.get_connection_info(),
        }
        if not self._closed:
            out.update(self.pool.stats())
        if self._server is not None:  # side-channel connections now, and refused for the cap
            out["peers"] = self._server.open_peers
            out["peers_refused"] = self._server.refused_peers
        return out

    def close(self) -> None:
        """Stop the side channel, free exposed blocks, unregister the pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._exposed.free_all()
        try:
            self.engine.unregister(self.base_ptr)
        except Exception as e:
            logger.debug("unregister_memory failed during close: %s", e)
        self.engine.close()
