"""What one load did, and how a worker reports it (stats, scheduler metadata, logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.connector.stats import OmniKVConnectorStats
from vllm_omni_kv.logger import LogBudget, init_logger

logger = init_logger(__name__)
#: a failed load's line (a hostile producer or client can fail one per request)
_failures = LogBudget(logger)


@dataclass
class Outcome:
    req_id: str
    ok: bool
    block_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    write_seconds: float = 0.0  # verifying and writing the bytes into the cache
    error: str = ""
    timed_out: bool = False
    refused: bool = False  # the payload was refused (prompt, model, layout, bytes)
    cancelled: bool = False
    #: the payload's format (``shared_pages``, ``paged_blocks``, ``token_major``)
    format: str = ""
    #: what carried it (the backend's transport, e.g. ``shm``, ``nixl:UCX``)
    transport: str = ""

    @property
    def reason(self) -> str:
        """Why the load failed (a ``FAILURE_REASONS`` value of the stats)."""
        if self.timed_out:
            return "timeout"
        if self.cancelled:
            return "cancelled"
        return "refused" if self.refused else "transport"


def report(
    out: Outcome,
    stats: OmniKVConnectorStats,
    invalid_blocks: set[int],
    failed: set[str] | None = None,
) -> dict[str, Any]:
    """Record ``out`` in ``stats`` (a failed load's blocks in ``invalid_blocks``, or with
    ``failed`` given, its request in ``failed``: vLLM maps no block ids of a model with
    several KV cache groups), log it, and return the ``omni_kv_load`` entry the
    scheduler half receives."""
    stats.record_recv(out.nbytes, out.seconds, out.tokens, out.ok, out.reason, out.transport)
    if out.ok:
        logger.debug(
            "loaded %d tokens of %s: %d bytes in %.2f ms",
            out.tokens,
            out.req_id,
            out.nbytes,
            out.seconds * 1e3,
        )
    elif out.cancelled:
        logger.info(
            "OmniKVConnector: KV load of request %s cancelled after %.3fs (%s)",
            out.req_id,
            out.seconds,
            out.error,
        )
    else:
        if failed is not None:
            failed.add(out.req_id)
            out.block_ids = []
        invalid_blocks.update(out.block_ids)
        _failures.warning(
            "OmniKVConnector: KV load of request %s failed after %.2fs: %s; %s reported "
            "failed (kv_load_failure_policy decides: recompute or fail)",
            out.req_id,
            out.seconds,
            out.error,
            f"its {len(out.block_ids)} blocks are" if out.block_ids else "the request is",
        )
    return {
        "ok": out.ok,
        "tokens": out.tokens,
        "bytes": out.nbytes,
        "seconds": round(out.seconds, 6),
        "write_seconds": round(out.write_seconds, 6),
        "error": out.error,
        **({"format": out.format} if out.ok and out.format else {}),
        **({"transport": out.transport} if out.ok and out.transport else {}),
    }
