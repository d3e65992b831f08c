"""Pull-based transfer-engine connector: the logic shared by Mooncake TE and Yuanrong TE.

Data path (sender -> receiver):

1. ``put`` places the payload in the sender's registered pool: a
   ``ManagedBuffer`` of that pool is exposed as is (zero copy), a tensor or
   bytes are copied once, any other object is laid out with
   :func:`codec.encode` and packed straight into the pool (one copy).
2. The receiver learns address, size and kind over the ZMQ side channel
   (``acquire`` grants a short lease so the TTL sweeper cannot free the block
   mid-transfer), allocates from its own pool and pulls with the engine's
   synchronous read, bounded by ``transfer_timeout_s``. Leases are held per
   receiver thread: when a busy sender answers an acquire after the receiver
   gave up waiting, the receiver's retry replaces that orphan lease instead of
   finding the key "exhausted" until the lease lapses.
3. ``release`` tells the sender the pull finished; its reply confirms the
   block was still live for the whole pull (otherwise the data is discarded).
   The block is freed after ``max_pulls`` pulls (``0``: kept until
   ``cleanup``/TTL), so one sender can feed N receivers.

Buffers never pulled are freed ``buffer_ttl_s`` after ``put``.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, Protocol

import numpy as np
import torch

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.exposure import ExposureTable
from vllm_omni_kv.backends.pool import ManagedBuffer, MemoryPool
from vllm_omni_kv.backends.side_channel import (
    SideChannelClient,
    SideChannelServer,
    local_ip,
    sender_zmq_port,
)
from vllm_omni_kv.errors import ConfigError, KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer import codec
from vllm_omni_kv.transfer.payload import KVCacheTransferData

logger = init_logger(__name__)

ROLES = ("sender", "receiver", "dual")


class EngineAdapter(Protocol):
    """The few engine operations the connector needs."""

    session: str  # "host:rpc_port" that peers pass as target_hostname

    def register(self, addr: int, size: int) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def read(self, session: str, local_addr: int, remote_addr: int, length: int) -> None: ...
    def close(self) -> None: ...


class PullTransferConnector(OmniConnectorBase):
    """Shared implementation; subclasses provide ``_make_engine``."""

    supports_raw_data: bool = True
    backend_name = "transfer-engine"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._closed = True  # until fully constructed (``__del__`` safety)
        self.config = dict(config or {})
        cfg = self.config
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
            self.get_timeout_s = float(cfg.get("get_timeout_s", 0.0))
            self.raise_on_timeout = bool(cfg.get("raise_on_timeout", False))
            self.frame_checksum = bool(cfg.get("frame_checksum", True))
            lease_slack_s = float(cfg.get("lease_slack_s", 5.0))
            self.zmq_port = sender_zmq_port(cfg) if self.can_put else 0
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{type(self).__name__}: bad numeric setting: {e}") from None
        if self.max_pulls < 0 or self.buffer_ttl_s <= 0 or self.transfer_timeout_s <= 0:
            raise ConfigError(
                "max_pulls >= 0, buffer_ttl_s > 0 and transfer_timeout_s > 0 required"
            )
        self.pool_device = str(cfg.get("memory_pool_device", "cpu"))
        self.engine_id = uuid.uuid4().hex
        self.sender_host: str | None = cfg.get("sender_host")
        sp = cfg.get("sender_zmq_port")
        self.sender_zmq_port: int | None = None if sp is None else int(sp)
        self._rank_senders: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._exposed = ExposureTable(self.buffer_ttl_s, self.max_pulls, lease_slack_s)
        self._stats: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "misses", "bytes_put", "bytes_got", "timeouts", "failures"),
            0,
        )
        self._server: SideChannelServer | None = None
        self._client: SideChannelClient | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        self.engine: EngineAdapter = self._make_engine()
        try:
            self.pool = MemoryPool(self.pool_size, self.pool_device)
            self.allocator = self.pool.allocator
            self.base_ptr = self.pool.base_ptr
            self._host_pool = self.pool.device.type == "cpu"
            self.engine.register(self.base_ptr, self.pool.size)
        except BaseException:
            self.engine.close()
            raise
        self.rpc_port = int(self.engine.session.rsplit(":", 1)[1])
        try:
            if self.can_put:
                self._server = SideChannelServer(
                    self.host,
                    self.zmq_port,
                    self._handle,
                    on_idle=self._exposed.sweep,
                    idle_interval_s=min(0.5, self.buffer_ttl_s / 4),
                )
                self.zmq_port = self._server.port
            self._client = SideChannelClient(self.side_channel_timeout_s)
            self._executor = cf.ThreadPoolExecutor(4, thread_name_prefix="omnikv-pull")
        except BaseException:
            self._shutdown()
            raise
        self._closed = False

    # -- subclass hook -------------------------------------------------------------
    def _make_engine(self) -> EngineAdapter:
        raise NotImplementedError

    @staticmethod
    def _make_key(key: str, from_stage: str, to_stage: str) -> str:
        return f"{key}@{from_stage}->{to_stage}"

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
        key = self._make_key(put_key, from_stage, to_stage)
        buf, size, fast, dtype, shape = self._stage_in_pool(data)
        entry = self._exposed.add(key, buf, size, fast, dtype, shape)
        with self._lock:
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
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

    def _stage_in_pool(
        self, data: Any
    ) -> tuple[ManagedBuffer, int, bool, str | None, list[int] | None]:
        if isinstance(data, ManagedBuffer):
            if self.pool.owns(data):
                if data.released:
                    raise KVTransferError("cannot put a ManagedBuffer that was already released")
                return data, data.size, True, None, None  # zero copy: we now own it
            data = data.tensor
        if isinstance(data, torch.Tensor):
            name = codec.DTYPE_NAMES.get(data.dtype)
            if name is None:
                raise KVTransferError(f"tensor dtype {data.dtype} is not supported")
            n = data.numel() * data.element_size()
            buf = self.pool.alloc(max(n, 1))
            try:
                if n and self._host_pool and data.device.type == "cpu" and data.is_contiguous():
                    # one plain memcpy: torch's copy_ goes through its intra-op thread pool,
                    # which costs milliseconds per call on a busy host
                    ctypes.memmove(buf.address, data.data_ptr(), n)
                elif n:
                    buf.tensor[:n].view(data.dtype).view(data.shape).copy_(data)
            except BaseException:
                buf.release()
                raise
            return _sized(buf, n), n, True, name, list(data.shape)
        if isinstance(data, (bytes, bytearray, memoryview)):
            mv = memoryview(data).cast("B")
            buf = self.pool.alloc(max(mv.nbytes, 1))
            if mv.nbytes and self._host_pool:
                buf.tensor.numpy()[: mv.nbytes] = np.frombuffer(mv, dtype=np.uint8)
            elif mv.nbytes:
                with warnings.catch_warnings():  # read-only sources are fine to copy from
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(mv, dtype=torch.uint8)
                buf.tensor[: mv.nbytes].copy_(src)
            return _sized(buf, mv.nbytes), mv.nbytes, True, None, None
        if isinstance(data, KVCacheTransferData):
            frame = data.frame()
        elif isinstance(data, codec.Frame):
            frame = data
        else:
            frame = codec.encode(data)
        buf = self.pool.alloc(frame.nbytes)
        try:
            if self.pool.device.type == "cpu":
                frame.pack_into(buf.tensor.numpy(), checksum=self.frame_checksum)
            else:
                buf.tensor.copy_(frame.to_device_tensor(self.pool.device))
        except BaseException:
            buf.release()
            raise
        return buf, frame.nbytes, False, None, None

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "acquire":
            holder = msg.get("holder")
            reply = self._exposed.acquire(
                str(msg.get("key", "")),
                float(msg.get("lease_s", self.transfer_timeout_s)),
                None if holder is None else str(holder),
            )
            if reply["ok"]:
                reply["session"] = self.engine.session
            return reply
        if op == "release":
            lease = msg.get("lease")
            return self._exposed.release(
                str(msg.get("token", "")),
                None if lease is None else str(lease),
                bool(msg.get("success", True)),
            )
        if op == "ping":
            return {"ok": True, "engine_id": self.engine_id, "session": self.engine.session}
        return {"ok": False, "reason": "error", "error": f"unknown side-channel op {op!r}"}

    def retain(self, from_stage: str, to_stage: str, put_key: str, pulls: int = 1) -> bool:
        """Allow ``pulls`` more receivers to pull ``put_key`` (and restart its TTL)."""
        return self._exposed.retain(self._make_key(put_key, from_stage, to_stage), pulls)

    def release(self, from_stage: str, to_stage: str, put_key: str) -> None:
        """Stop exposing ``put_key``; the block is freed once in-flight pulls finish."""
        self.cleanup(put_key, from_stage, to_stage)

    def cleanup(
        self, request_id: str, from_stage: str | None = None, to_stage: str | None = None
    ) -> None:
        """Free the producer-side blocks of ``request_id`` (every edge unless both stages given)."""
        if from_stage is not None and to_stage is not None:
            key = self._make_key(request_id, from_stage, to_stage)
            self._exposed.retire_where(lambda k: k == key)
        else:
            prefix = f"{request_id}@"
            self._exposed.retire_where(lambda k: k == request_id or k.startswith(prefix))

    # -- consumer side -----------------------------------------------------------------
    def update_sender_info(
        self, sender_host: str, sender_zmq_port: int, sender_rank: int | None = None
    ) -> None:
        """Set the default sender (``sender_rank=None``) or the endpoint of one sender rank."""
        if sender_rank is None:
            self.sender_host, self.sender_zmq_port = sender_host, int(sender_zmq_port)
        else:
            self._rank_senders[int(sender_rank)] = (sender_host, int(sender_zmq_port))

    def _endpoint(self, metadata: dict[str, Any] | None) -> str:
        md = metadata or {}
        if md.get("source_host") and md.get("source_port"):
            return f"tcp://{md['source_host']}:{int(md['source_port'])}"
        rank = md.get("sender_rank", md.get("from_rank"))
        if rank is not None and int(rank) in self._rank_senders:
            h, p = self._rank_senders[int(rank)]
            return f"tcp://{h}:{p}"
        if self.sender_host and self.sender_zmq_port:
            return f"tcp://{self.sender_host}:{self.sender_zmq_port}"
        raise KVTransferError(
            "no sender endpoint known for get(): pass metadata with source_host/source_port, "
            "or call update_sender_info(host, zmq_port) first"
        )

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Pull ``get_key``; ``(ManagedBuffer, size)`` for tensors/bytes (caller releases),
        ``(object, size)`` otherwise; None when absent or on a bounded failure."""
        self._check_open()
        if not self.can_get:
            raise KVTransferError(
                f"this connector's role is {self.role!r}: it cannot get; use role 'receiver' or 'dual'"
            )
        assert self._client is not None
        key = self._make_key(get_key, from_stage, to_stage)
        endpoint = self._endpoint(metadata)
        md = dict(metadata or {})
        lease: str | None = None
        if not all(md.get(k) is not None for k in ("data_size", "src_addr", "session", "token")):
            try:
                info = self._acquire(endpoint, key)
            except KVTransferTimeout as e:
                self._timed_out(e)
                return None
            if info is None:
                with self._lock:
                    self._stats["misses"] += 1
                return None
            md.update(info)
            lease = info["lease"]
        size = int(md["data_size"])
        try:
            local = self.pool.alloc(max(size, 1))
        except KVTransferError:
            self._release_remote(endpoint, key, md["token"], lease, success=False)
            raise
        ok = self._pull(md["session"], local, int(md["src_addr"]), size, key)
        if ok is None:
            self._release_remote(endpoint, key, md["token"], lease, success=False)
            self._timed_out(
                KVTransferTimeout(
                    f"pull of {key!r} ({size} bytes) from {md['session']} stalled past "
                    f"transfer_timeout_s={self.transfer_timeout_s:.1f}s"
                )
            )
            return None
        live = self._release_remote(endpoint, key, md["token"], lease, success=ok)
        if not ok or not live:
            if ok:  # the pull itself finished; the block was freed under us
                local.release()
                logger.warning("%r expired or was cleaned up on the sender during the pull", key)
            with self._lock:
                self._stats["failures"] += 1
            return None
        with self._lock:
            self._stats["gets"] += 1
            self._stats["bytes_got"] += size
        if md.get("is_fast_path", True):
            out = _sized(local, size)
            out.dtype_name, out.shape = md.get("dtype"), md.get("shape")
            return out, size
        return self._decode(local, size), size

    def _timed_out(self, err: KVTransferTimeout) -> None:
        with self._lock:
            self._stats["timeouts"] += 1
        if self.raise_on_timeout:
            raise err
        logger.error("%s; returning None", err)
        return None

    def _acquire(self, endpoint: str, key: str) -> dict[str, Any] | None:
        assert self._client is not None
        deadline = time.monotonic() + self.get_timeout_s
        delay = 0.005
        # one thread's gets are sequential: naming (engine, thread) as the holder lets the
        # sender replace a lease this thread abandoned when an earlier acquire timed out
        msg = {
            "op": "acquire",
            "key": key,
            "lease_s": self.transfer_timeout_s,
            "holder": f"{self.engine_id}:{threading.get_ident()}",
        }
        while True:
            reply = self._client.request(endpoint, msg)
            if reply.get("ok"):
                return reply
            if reply.get("reason") == "error":
                raise KVTransferError(f"sender at {endpoint} failed: {reply.get('error')}")
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _release_remote(
        self, endpoint: str, key: str, token: str, lease: str | None, success: bool
    ) -> bool:
        assert self._client is not None
        try:
            reply = self._client.request(
                endpoint,
                {"op": "release", "key": key, "token": token, "lease": lease, "success": success},
            )
        except KVTransferError as e:
            logger.warning("could not confirm pull of %r with its sender: %s", key, e)
            return False
        return bool(reply.get("ok"))

    def _pull(
        self, session: str, local: ManagedBuffer, remote_addr: int, size: int, key: str
    ) -> bool | None:
        """True: pulled; False: failed (logged); None: stalled past the timeout."""
        if size == 0:
            return True
        assert self._executor is not None
        fut = self._executor.submit(self.engine.read, session, local.address, remote_addr, size)
        try:
            fut.result(timeout=self.transfer_timeout_s)
            return True
        except cf.TimeoutError:
            # the engine may still write into ``local``: free it only when the read ends
            fut.add_done_callback(lambda _f: local.release())
            return None
        except Exception as e:
            local.release()
            logger.error("pull of %r (%d bytes) from %s failed: %s", key, size, session, e)
            return False

    def _decode(self, local: ManagedBuffer, size: int) -> Any:
        if self.pool.device.type != "cpu":
            try:
                return codec.decode_tensor(local.tensor[:size].clone())
            finally:
                local.release()
        # decoded tensors are views of the pool: the block is released when they are gone
        view = (ctypes.c_char * size).from_address(local.address)
        weakref.finalize(view, local.release)
        try:
            return codec.decode(view)
        except BaseException:
            local.release()
            raise

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

    def health(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self._stats)
        out: dict[str, Any] = {
            "status": "closed" if self._closed else "healthy",
            "backend": self.backend_name,
            "role": self.role,
            **self._exposed.counts(),
            **stats,
            **self.get_connection_info(),
        }
        if not self._closed:
            out.update(self.pool.stats())
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


def _sized(buf: ManagedBuffer, size: int) -> ManagedBuffer:
    """Report the payload size (not the aligned block size) on a pool buffer."""
    buf.size = size
    return buf
