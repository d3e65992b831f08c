"""``NixlPullConnector``: pull-based KV transfer over NIXL agents (UCX by default).

The protocol is the pull connector's (:mod:`vllm_omni_kv.backends.pull.pull`):
``put`` stages the frame in the sender's registered pool and exposes it in an
:class:`~vllm_omni_kv.backends.pull.exposure.ExposureTable`; the receiver
``acquire``\\ s a lease over the TCP side channel, pulls prelude, header and trailer,
then only the chunk ranges ``load(spans)`` needs (each verified by the codec), and
``release``\\ s. NIXL replaces the Mooncake engine: the pool is registered once with
the sender's agent, and the receiver loads that agent's metadata over the same side
channel (op ``nixl_md``; see :mod:`.engine`) before its first read.

Config keys: those of the pull connector (``role``, ``host``, ``zmq_port``,
``memory_pool_size``, ``memory_pool_device``, ``max_pulls``, ``buffer_ttl_s``,
``transfer_timeout_s``, ``side_channel_timeout_s``, ``get_timeout_s``,
``raise_on_timeout``, ``lease_slack_s``, ``frame_checksum``, ``require_digests``, ``sender_host`` /
``sender_zmq_port``, ``auth_key_file``) plus ``nixl_backends`` (default ``["UCX"]``),
``nixl_num_threads`` (UCX worker threads, 0 = NIXL's default), ``nixl_progress_wait_us``
(the longest NIXL's progress thread sleeps between UCX events, default 1000; 0 = NIXL's
Python default, a progress thread that spins on a core; see :func:`.loader.make_agent`),
``handshake_timeout_s`` (per try, default ``side_channel_timeout_s``) and
``handshake_retries`` (default 1), ``nixl_direction`` (``auto``: the producer WRITEs where
the memory read would be a GPU's, since UCX may serve a READ of it by TCP; ``read``;
``write``; see :mod:`.engine`), ``register_cache`` and ``verify_pages`` (as for
``mooncake_te``: this engine's KV cache is registered with the agent too, ``DRAM`` on
CPU and ``VRAM`` of its device on a GPU, and consumers pull just the page runs they
lack straight out of it; see
:class:`~vllm_omni_kv.backends.pull.cache_region.CacheRegionConnector`).

What runs where: on CPU the pool is host memory (``DRAM``) and UCX moves it over
shared memory / TCP on one host, RDMA between hosts where present. With
``memory_pool_device: cuda[:N]`` the pool is registered as ``VRAM`` (GPU-direct
with UCX's cuda transports); that path is written but has not run on a GPU in
this project's CI, and a device pool is pulled whole (no ranged loads). The same
holds for a CUDA KV cache registered with ``register_cache`` (``VRAM``, read device
to device): written, not run on a GPU yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm_omni_kv.backends.nixl.engine import DIRECTIONS, NixlEngine
from vllm_omni_kv.backends.nixl.handshake import MD_OP
from vllm_omni_kv.backends.nixl.loader import PROGRESS_WAIT_US
from vllm_omni_kv.backends.nixl.write_wire import WRITE_OPS
from vllm_omni_kv.backends.pull.cache_region import CacheRegionConnector
from vllm_omni_kv.backends.pull.pull import EngineAdapter
from vllm_omni_kv.errors import ConfigError


class NixlPullConnector(CacheRegionConnector):
    """Omni connector over NIXL with a managed, registered pool (and with
    ``register_cache``, the KV cache registered too)."""

    backend_name = "nixl"
    CONFIG_KEYS: ClassVar[frozenset[str]] = CacheRegionConnector.CONFIG_KEYS | frozenset(
        (
            "nixl_backends nixl_num_threads handshake_timeout_s handshake_retries nixl_direction "
            "nixl_progress_wait_us"
        ).split()
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._nixl: NixlEngine | None = None
        super().__init__(config)
        assert self._nixl is not None
        self._nixl.advertise(self.host, self.zmq_port)
        self.rpc_port = self.zmq_port  # NIXL peers are reached through the side channel

    def _make_engine(self) -> EngineAdapter:
        cfg = self.config
        raw = cfg.get("nixl_backends", ["UCX"])
        backends = (raw,) if isinstance(raw, str) else tuple(str(b) for b in raw)
        try:
            hs_timeout = float(cfg.get("handshake_timeout_s", self.side_channel_timeout_s))
            hs_retries = int(cfg.get("handshake_retries", 1))
            threads = int(cfg.get("nixl_num_threads", 0))
            wait_us = int(cfg.get("nixl_progress_wait_us", PROGRESS_WAIT_US))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"NixlPullConnector: bad numeric setting: {e}") from None
        direction = str(cfg.get("nixl_direction", "auto"))
        if direction not in DIRECTIONS:
            raise ConfigError(f"nixl_direction must be one of {DIRECTIONS}, got {direction!r}")
        if not backends or hs_timeout <= 0 or hs_retries < 0 or wait_us < 0:
            raise ConfigError(
                "NixlPullConnector needs nixl_backends (e.g. ['UCX']), handshake_timeout_s > 0, "
                "handshake_retries >= 0 and nixl_progress_wait_us >= 0"
            )
        self._nixl = NixlEngine(
            device=self.pool_device,
            backends=backends,
            num_threads=threads,
            timeout_s=self.transfer_timeout_s,
            handshake_timeout_s=hs_timeout,
            handshake_retries=hs_retries,
            auth=self.auth,
            direction=direction,
            progress_wait_us=wait_us,
        )
        return self._nixl

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") in WRITE_OPS:
            assert self._nixl is not None
            return self._nixl.writer(msg)
        if msg.get("op") == MD_OP:
            assert self._nixl is not None
            try:
                return {"ok": True, **self._nixl.metadata()}
            except Exception as e:  # closing: the agent is gone
                return {"ok": False, "reason": "error", "error": f"{type(e).__name__}: {e}"}
        return super()._handle(msg)

    def _shutdown(self) -> None:
        """The producer's writes end (aborted) before its side channel closes: a consumer
        takes a refused connection for "no write of that producer can land any more"."""
        if self._nixl is not None:
            self._nixl.writer.close()
        super()._shutdown()

    @property
    def agent_name(self) -> str:
        assert self._nixl is not None
        return self._nixl.name


def selftest() -> dict[str, Any]:
    """Round trip (tensor + object) between two connectors of this process over NIXL/UCX."""
    try:
        from vllm_omni_kv.backends.pull.selftest import pull_round_trip

        base = {
            "host": "127.0.0.1",
            "zmq_port": 0,
            "memory_pool_size": 8 << 20,
            "transfer_timeout_s": 10.0,
        }
        sender = NixlPullConnector({**base, "role": "sender"})
        try:
            receiver = NixlPullConnector({**base, "role": "receiver"})
            try:
                failed = pull_round_trip(sender, receiver)
                if failed:
                    return {"ok": False, "detail": failed}
                return {
                    "ok": True,
                    "detail": f"NIXL/UCX {sender.agent_name} -> {receiver.agent_name}: "
                    "tensor + object",
                    "transport": receiver.transport(),
                }
            finally:
                receiver.close()
        finally:
            sender.close()
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def cache_selftest() -> dict[str, Any]:
    """``register_cache``: pages of one connector's registered cache pulled by another
    over NIXL/UCX (two agents of this process)."""
    from vllm_omni_kv.backends.pull.selftest import cache_round_trip

    return cache_round_trip(NixlPullConnector)


def write_selftest() -> dict[str, Any]:
    """``register_cache`` pages moved by the producer's NIXL ``WRITE`` into the consumer's
    registered cache (``nixl_direction: write``; two agents of this process)."""
    from vllm_omni_kv.backends.pull.selftest import cache_round_trip

    return cache_round_trip(NixlPullConnector, nixl_direction="write")
