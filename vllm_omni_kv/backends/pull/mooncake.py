"""``MooncakeTransferEngineConnector``: pull-based KV transfer over Mooncake Transfer Engine.

The receiver pulls from the sender's registered pool with the engine's reads (RDMA, or TCP
on hosts without RDMA), after learning address and size over a TCP side channel; see
:mod:`vllm_omni_kv.backends.pull.pull` for the protocol, pulls by N
receivers (``max_pulls``), TTL expiry and timeouts.

Config keys: ``role`` (sender / receiver / dual), ``host`` ("auto": this
host's outbound IP), ``protocol`` ("rdma" | "tcp"), ``device_name`` (RDMA NIC,
"" = auto), ``metadata_server`` ("P2PHANDSHAKE", or an etcd / http metadata
URL), ``memory_pool_size`` (bytes, default 1 GiB), ``memory_pool_device``
("cpu" or "cuda[:N]"), ``zmq_port`` (base side-channel port, per stage / rank
via ``kv_zmq_port`` when ``from_stage`` is set; 0 = random), ``sender_host`` /
``sender_zmq_port`` (default sender for receivers), ``max_pulls`` (pulls per
put before the block is freed; 0 = until cleanup/TTL), ``buffer_ttl_s``,
``transfer_timeout_s``, ``side_channel_timeout_s``, ``get_timeout_s`` (how long
``get`` keeps asking for a key that is not there yet), ``raise_on_timeout``
(raise ``KVTransferTimeout`` instead of logging and returning None),
``lease_slack_s``, ``frame_checksum`` (chunk digests in packed objects, default True),
``require_digests`` (a receiver refuses frames without digests, default True),
``tcp_progress_timeout_s``
(default 3: Mooncake's TCP transport drops a connection that moves no byte for
this long, and the pull is retried on a fresh one; it sets
``MC_TCP_PROGRESS_TIMEOUT_SEC`` unless that is already in the environment),
``register_cache`` (default False: register the engine's KV cache with the
transfer engine, so that consumers pull the pages they lack straight out of it and
payloads are small frames of block ids; see
:mod:`vllm_omni_kv.backends.pull.cache_region`. Set it on both stages. A
CUDA cache is registered as device memory with the CUDA build only, a path not run on
a GPU yet), ``verify_pages`` (with ``register_cache``: a digest per page, verified by
consumers; host caches; default false).

Inside vLLM's CPU workers the main thread busy-waits pinned to one core; the
connector starts the transfer engine's I/O threads on the process's other CPUs
(``transfer_cpus``, see :mod:`vllm_omni_kv.connector.affinity`), where they would
otherwise inherit that pin and stall for seconds. The progress timeout is a safety net
for stalls of the TCP transport itself (e.g. upstream kvcache-ai/Mooncake#4209),
turning one into a ~3 s retry. Reads of a few ranges are polled with sleeps
(:meth:`MooncakeEngine.read_many`).

Packages: ``pip install mooncake-transfer-engine`` (CUDA builds) or
``pip install mooncake-transfer-engine-non-cuda`` (CPU-only hosts).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from typing import Any, ClassVar

from vllm_omni_kv.backends.backoff import Backoff
from vllm_omni_kv.backends.pull.cache_region import CacheRegionConnector
from vllm_omni_kv.backends.pull.page_reads import PageReads
from vllm_omni_kv.backends.pull.pull import EngineAdapter
from vllm_omni_kv.errors import BackendUnavailable, KVTransferError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: ranges per batched engine read: the transfer engine refuses (-1) a batch of more (TCP,
#: measured with 2048 and 2049 ranges of 8 KiB); a larger move is read in several batches
MAX_BATCH_READS = 2048
#: reads of at most this many ranges are polled range by range (:meth:`MooncakeEngine.read_many`)
POLLED_RANGES = 4
#: the binding's own bound on a synchronous transfer without ``MC_TRANSFER_TIMEOUT`` (s),
#: plus a second per GB moved; a polled read is bounded the same way
SYNC_TIMEOUT_S = 30.0
#: what the binding's asynchronous submit returns where it submitted nothing (0; -1 as
#: its unsigned batch id in builds that return -1 for a peer it cannot open)
_NO_BATCH = frozenset({0, -1, (1 << 64) - 1})


def _sync_timeout_s(nbytes: int) -> float:
    """How long the binding lets a synchronous transfer of ``nbytes`` run."""
    try:
        base = max(5.0, float(int(os.environ.get("MC_TRANSFER_TIMEOUT", SYNC_TIMEOUT_S))))
    except ValueError:
        base = SYNC_TIMEOUT_S
    return base + nbytes / 1e9


INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (CPU-only hosts) or "
    "pip install mooncake-transfer-engine (CUDA hosts)"
)


def _dists() -> list[str]:
    return list(importlib.metadata.packages_distributions().get("mooncake", []))


def cuda_build() -> bool:
    """Whether the ``mooncake`` package comes from the CUDA build (``mooncake-transfer-engine``,
    not ``mooncake-transfer-engine-non-cuda``, whose transports take every address for host
    memory)."""
    dists = _dists()
    return bool(dists) and not any("non-cuda" in d or "non_cuda" in d for d in dists)


def import_engine() -> Any:
    """``mooncake.engine.TransferEngine``, or ``BackendUnavailable`` naming the package."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise BackendUnavailable(
            f"the Mooncake transfer engine is not importable ({e}); install it with: {INSTALL_HINT}"
        ) from e
    return TransferEngine


def local_devices(engine: Any) -> list[str]:
    """The devices (NICs, or ``cpu:N`` for TCP) in the engine's local topology."""
    try:
        topology = json.loads(engine.get_local_topology())
    except Exception:  # older bindings, or a topology that is not JSON
        return []
    return sorted(str(k) for k in topology) if isinstance(topology, dict) else []


class MooncakeEngine:
    """Adapter from the Mooncake ``TransferEngine`` binding to :class:`EngineAdapter`."""

    def __init__(
        self,
        host: str,
        protocol: str = "rdma",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        rpc_port: int | None = None,
        progress_timeout_s: float | None = None,
    ) -> None:
        if progress_timeout_s is not None:  # bounds a TCP transfer that stops progressing
            os.environ.setdefault(
                "MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, round(progress_timeout_s)))
            )
        engine_cls = import_engine()
        self.engine = engine_cls()
        local_name = host if rpc_port is None else f"{host}:{rpc_port}"
        ret = self.engine.initialize(local_name, metadata_server, protocol, device_name)
        if ret != 0:
            raise BackendUnavailable(
                f"Mooncake TransferEngine.initialize({local_name!r}, {metadata_server!r}, "
                f"{protocol!r}, {device_name!r}) failed with code {ret}. For protocol 'rdma' "
                "check device_name and that RDMA NICs are present; on hosts without RDMA use "
                "protocol='tcp'. A non-P2PHANDSHAKE metadata_server must be reachable."
            )
        #: short reads are submitted and polled (:meth:`read_many`), where the binding can
        self._polled = all(
            hasattr(self.engine, m) for m in ("batch_transfer_async_read", "transfer_check_status")
        )
        if metadata_server == "P2PHANDSHAKE":
            self.session = f"{host}:{self.engine.get_rpc_port()}"
        else:
            self.session = local_name
        self.protocol, self.device_name = protocol, device_name
        logger.info(
            "Mooncake transfer engine %s: protocol %s, devices %s",
            self.session,
            protocol,
            ", ".join(local_devices(self.engine)) or device_name or "auto",
        )

    def transport(self) -> str:
        """The engine's protocol, and its devices where they were named."""
        return f"{self.protocol}[{self.device_name}]" if self.device_name else self.protocol

    def register(self, addr: int, size: int) -> None:
        ret = self.engine.register_memory(addr, size)
        if ret != 0:
            raise KVTransferError(
                f"Mooncake register_memory({addr:#x}, {size}) failed with code {ret}: the pool "
                "could not be registered (memlock limits? try a smaller memory_pool_size)"
            )

    def register_device(self, addr: int, size: int, device: str) -> None:
        """Register memory of a torch ``device``: host memory as :meth:`register`; GPU
        memory (a CUDA KV cache) only with a CUDA build, whose transports move device
        memory (its TCP transport through a host bounce buffer, RDMA by GPUDirect). Not
        run on a GPU in this project yet."""
        if not device.startswith("cpu") and not cuda_build():
            raise KVTransferError(
                f"the installed Mooncake build ({', '.join(_dists()) or '?'}) cannot move "
                f"{device} memory: install mooncake-transfer-engine (the CUDA build)"
            )
        if not device.startswith("cpu") and self.protocol == "tcp":
            logger.warning(
                "Mooncake moves %s memory over TCP through host bounce buffers (a fraction of "
                "the link): use protocol 'rdma' (GPUDirect) between hosts, or backend 'shm' "
                "/ 'cuda_ipc' within one host",
                device,
            )
        self.register(addr, size)

    def unregister(self, addr: int) -> None:
        self.engine.unregister_memory(addr)

    def read(self, session: str, local_addr: int, remote_addr: int, length: int) -> None:
        """One range (:meth:`read_many`)."""
        self.read_many(session, [(local_addr, remote_addr, length)])

    def read_many(self, session: str, reads: list[tuple[int, int, int]]) -> None:
        """``(local, remote, bytes)`` reads from ``session``. At most :data:`POLLED_RANGES`
        ranges (a frame's head and tail, its body, a small pull) are submitted as batches
        of one and polled with :class:`Backoff`'s sleeps where the binding can: its
        synchronous calls poll without pause, holding a core that the engine's own I/O
        threads need on a busy host. More ranges, and reads the binding would not submit,
        go through its synchronous batches (:meth:`read_pages`)."""
        if self._polled and len(reads) <= POLLED_RANGES and self._read_polled(session, reads):
            return
        self._read_batches(session, reads)

    def read_pages(self, session: str, reads: PageReads) -> None:
        """One move's page ranges: one synchronous batch per :data:`MAX_BATCH_READS`
        ranges, so the posts per move do not grow with its pages."""
        self._read_batches(session, reads.ranges())

    def _read_batches(self, session: str, reads: list[tuple[int, int, int]]) -> None:
        """Batches of at most :data:`MAX_BATCH_READS` ranges (the engine refuses larger
        ones over TCP), each waited for by the binding, which also drops a peer's cached
        segment that no longer answers and handshakes it again."""
        for i in range(0, len(reads), MAX_BATCH_READS):
            batch = reads[i : i + MAX_BATCH_READS]
            local, remote, lengths = (list(x) for x in zip(*batch, strict=True))
            ret = self.engine.batch_transfer_sync_read(session, local, remote, lengths)
            if ret < 0:
                raise KVTransferError(
                    f"Mooncake read of {len(batch)} ranges from {session} failed ({ret}): "
                    "the sender is gone or its buffer is no longer registered"
                )

    def _read_polled(self, session: str, reads: list[tuple[int, int, int]]) -> bool:
        """Each range as a batch of one, all in flight, then waited for. False where the
        binding would not submit one (the caller reads them all synchronously, once none
        runs); a range that failed raises, once none runs. A submit that raises (a range
        the binding cannot take) also waits for the ranges already in flight."""
        bids: list[int] = []
        refused = False
        try:
            for local, remote, n in reads:
                bid = self.engine.batch_transfer_async_read(session, [local], [remote], [n])
                if bid in _NO_BATCH:
                    refused = True
                    break
                bids.append(bid)
        finally:
            state = self._wait(bids, _sync_timeout_s(sum(r[2] for r in reads)), session)
        if state == 1:
            return not refused
        why = "failed" if state == -1 else "timed out in the engine"
        raise KVTransferError(
            f"Mooncake read of {len(reads)} range(s) from {session} {why}: the sender is "
            "gone, stalled, or its buffer is no longer registered"
        )

    def _wait(self, bids: list[int], bound_s: float, session: str) -> int:
        """Poll every batch to its end: 1 when all completed, else the state of one that
        did not (-1 failed, -2 timed out in the engine). Never returns while one runs: its
        destination may be freed once this returns (past ``bound_s`` it warns, and the
        caller, which stopped waiting at its own timeout, keeps the destination)."""
        backoff, worst = Backoff(), 1
        limit, warned = time.monotonic() + bound_s, False
        for bid in bids:
            while (state := self.engine.transfer_check_status(bid)) == 0:
                if not warned and time.monotonic() > limit:
                    warned = True
                    logger.warning(
                        "a Mooncake read from %s still runs %.0f s after it started; its "
                        "destination stays allocated until the engine ends it",
                        session,
                        bound_s,
                    )
                backoff.sleep()
            worst = worst if state == 1 else state
        return worst

    def close(self) -> None:
        self.engine = None  # the binding has no explicit shutdown; dropping it stops its threads


class MooncakeTransferEngineConnector(CacheRegionConnector):
    """Omni connector over the Mooncake Transfer Engine with a managed, registered pool
    (and with ``register_cache``, the KV cache registered too)."""

    backend_name = "mooncake_te"
    CONFIG_KEYS: ClassVar[frozenset[str]] = CacheRegionConnector.CONFIG_KEYS | frozenset(
        "protocol device_name metadata_server rpc_port tcp_progress_timeout_s".split()
    )

    def _make_engine(self) -> EngineAdapter:
        cfg = self.config
        rpc_port = cfg.get("rpc_port")
        return MooncakeEngine(
            self.host,
            protocol=str(cfg.get("protocol", "rdma")),
            device_name=str(cfg.get("device_name", "")),
            metadata_server=str(cfg.get("metadata_server", "P2PHANDSHAKE")),
            rpc_port=None if rpc_port is None else int(rpc_port),
            progress_timeout_s=min(
                self.transfer_timeout_s, float(cfg.get("tcp_progress_timeout_s", 3.0))
            ),
        )

    @property
    def protocol(self) -> str:
        return str(self.config.get("protocol", "rdma"))

    @property
    def device_name(self) -> str:
        return str(self.config.get("device_name", ""))


def selftest() -> dict[str, Any]:
    """Loopback round trip (tensor + object) through one dual-role connector on 127.0.0.1/tcp."""
    try:
        from vllm_omni_kv.backends.pull.selftest import pull_round_trip

        cfg = {
            "role": "dual",
            "host": "127.0.0.1",
            "protocol": "tcp",
            "zmq_port": 0,
            "memory_pool_size": 8 << 20,
            "transfer_timeout_s": 10.0,
        }
        conn = MooncakeTransferEngineConnector(cfg)
        try:
            failed = pull_round_trip(conn, conn)
            if failed:
                return {"ok": False, "detail": failed}
            return {
                "ok": True,
                "detail": f"tcp loopback via {conn.engine.session}: tensor + object",
                "transport": conn.transport(),
            }
        finally:
            conn.close()
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def cache_selftest() -> dict[str, Any]:
    """``register_cache``: pages of one connector's registered cache pulled by another
    (two engines of this process, TCP on 127.0.0.1)."""
    from vllm_omni_kv.backends.pull.selftest import cache_round_trip

    return cache_round_trip(MooncakeTransferEngineConnector, protocol="tcp")
