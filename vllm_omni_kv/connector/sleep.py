"""vLLM's sleep mode on one worker: ``unregister_kv_caches`` and ``restore_kv_caches``.

vLLM 0.33 calls them around discarding and re-mapping the KV cache's memory
(``Worker.sleep`` / ``discard``, then ``Worker.wake_up``); vLLM 0.32 never does.

Sleep: the loads in flight are cancelled and waited for (none may write into memory
being discarded), and every load vLLM has not yet been told about becomes a failure,
so its blocks are recomputed. The producer voids every payload that names its cache's
blocks (packed payloads are copies: they stay) and its cache region moves to an odd
generation: consumers refuse anything exported before
(:func:`~vllm_omni_kv.backends.cache_region.check_generation`); a registered cache is
unregistered, a consumer's mappings of producers' regions (CUDA IPC handles) are
dropped. Wake: the region's next, even generation, and the cache is exported
(registered) again; payloads carry the generation they were exported under.
Both are idempotent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.connector.outcome import Outcome
from vllm_omni_kv.connector.worker import OmniKVWorker
from vllm_omni_kv.errors import OmniKVError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: how long sleep waits for cancelled loads beyond ``recv_timeout`` (seconds)
LOAD_GRACE_S = 30.0
#: why a load that sleep overtook failed
LOST = "the KV cache was put to sleep (vLLM sleep mode) during this load: it is recomputed"


def supports_sleep(extra: Mapping[str, Any] | None, kv_role: str | None) -> bool:
    """Whether the backend of ``kv_connector_extra_config`` follows vLLM's sleep mode:
    every backend withdraws and restores its exports, except the Mooncake transfer
    engine with ``register_cache`` over RDMA, whose re-registration with its peers has
    run only over TCP here. ``ConfigError`` for a config the connector refuses anyway."""
    cfg = parse_omni_kv_config(extra, kv_role)
    opts = cfg.backend.extra
    if cfg.backend_name != "MooncakeTransferEngineConnector":
        return True
    register = str(opts.get("register_cache", False)).lower() in ("true", "1")
    return not register or str(opts.get("protocol", "rdma")) == "tcp"


class WorkerSleep:
    """Sleep and wake of one :class:`OmniKVWorker` (see the module docstring)."""

    def __init__(self, worker: OmniKVWorker) -> None:
        self.worker = worker
        self.asleep = False
        self._lost: set[str] = set()  # loads in flight or untaken when sleep came
        self._exported = False  # the producer exported its cache before sleep

    def sleep(self) -> None:
        """``unregister_kv_caches``: nothing may read or write the cache after it."""
        if self.asleep:
            return
        self.asleep = True
        w = self.worker
        self._fail_loads()
        voided = w._handoffs.void_shared() if w._handoffs is not None else 0
        self._exported, w._export = w._export is not None, None
        if w._region is not None:
            w._region.sleep()
        logger.info(
            "OmniKVConnector: KV cache asleep (vLLM sleep mode): %d loads failed (recomputed), "
            "%d payloads naming its blocks voided",
            len(self._lost),
            voided,
        )

    def wake(self) -> None:
        """``restore_kv_caches``: export (register) the cache again, a new generation."""
        if not self.asleep:
            return
        w = self.worker
        w.inflight.relabel(self._lose)  # loads that landed while asleep (past the wait) too
        self._lost = set()
        region = w._region
        if region is not None:
            try:
                region.wake()
            except OmniKVError as e:
                logger.warning(
                    "OmniKVConnector: the KV cache could not be registered again after sleep "
                    "(%s): sending packed payloads",
                    e,
                )
                region = None
        if region is not None and self._exported:
            w._export = w._export_pages()
        self.asleep = False
        logger.info(
            "OmniKVConnector: KV cache awake, generation %d",
            0 if region is None else region.generation,
        )

    def _fail_loads(self) -> None:
        """Cancel the loads in flight and wait until they stopped; every outcome vLLM has
        not taken becomes a failure (its blocks are recomputed)."""
        w = self.worker
        lost = w.inflight.cancel()
        w.inflight.wait(lambda running: bool(lost & running), w.cfg.recv_timeout + LOAD_GRACE_S)
        stuck = lost & w.inflight.running()
        self._lost = lost | w.inflight.relabel(_as_lost)
        if stuck:
            logger.error(
                "OmniKVConnector: loads of %s still run as the KV cache goes to sleep; they "
                "are reported failed",
                sorted(stuck),
            )

    def _lose(self, out: Outcome) -> Outcome:
        return _as_lost(out) if out.req_id in self._lost else out


def _as_lost(out: Outcome) -> Outcome:
    """``out`` as a load that sleep overtook."""
    return dataclasses.replace(
        out, ok=False, cancelled=False, timed_out=False, refused=False, error=LOST
    )
