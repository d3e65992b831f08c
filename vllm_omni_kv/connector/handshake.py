"""The producer's side-channel endpoint, from its workers to its scheduler.

A network backend (Mooncake / Yuanrong TE) without a configured ``zmq_port`` binds a
free port in each worker, so that two servers on one host never collide. vLLM hands
every worker's :meth:`get_handshake_metadata` to the scheduler once at engine start
(``set_xfer_handshake_metadata``); the scheduler then advertises that port (and the
backend's resolved host when the config says ``auto``) in ``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.kv_utils import sender_rank_port
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: ``host`` values a backend resolves to this machine's address itself
_AUTO_HOSTS = ("", "auto", "0.0.0.0")


@dataclass
class OmniKVHandshake(KVConnectorHandshakeMetadata):
    """One worker's side-channel endpoint (``port`` 0: the backend serves none)."""

    host: str
    port: int


def worker_handshake(endpoint: tuple[str, int] | None) -> OmniKVHandshake | None:
    """The handshake of a worker whose backend listens on ``endpoint`` (None: shared
    memory, stores, receivers)."""
    if endpoint is None:
        return None
    return OmniKVHandshake(host=endpoint[0], port=endpoint[1])


def advertise(cfg: OmniKVConfig, metadata: dict[int, Any]) -> OmniKVConfig:
    """``cfg`` with ``remote_host``/``remote_port`` the workers actually listen on.

    An explicit ``remote_port`` (or ``zmq_port``) is kept. Without one, rank 0's bound
    port is advertised; consumers address rank ``r`` at ``port + 16 r``, so a producer
    with several TP ranks on free ports must set ``zmq_port`` (a :class:`ConfigError`).
    """
    ends = {int(r): m for r, m in metadata.items() if isinstance(m, OmniKVHandshake)}
    if not ends or 0 not in ends:
        return cfg
    changes: dict[str, Any] = {}
    if cfg.remote_host in _AUTO_HOSTS:
        changes["remote_host"] = ends[0].host
    if cfg.remote_port == 0:
        base = ends[0].port
        wrong = {r: e.port for r, e in ends.items() if e.port != sender_rank_port(base, r)}
        if wrong:
            raise ConfigError(
                f"the producer's TP ranks listen on free side-channel ports "
                f"{ {r: e.port for r, e in sorted(ends.items())} }, but consumers address "
                "rank r at rank 0's port + 16 r: set backend_extra.zmq_port (a free base "
                "port) for a producer with tensor_parallel_size > 1"
            )
        changes["remote_port"] = base
    if changes:
        logger.info("OmniKVConnector: consumers pull from %s", changes)
    return dataclasses.replace(cfg, **changes) if changes else cfg
