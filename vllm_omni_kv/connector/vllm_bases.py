"""vLLM's connector base classes that the worker half's data types derive from.

Imported from vLLM when it is installed; on a machine without vLLM (the GPU check
machine: torch and CUDA only) minimal stand-ins with the same fields let the
worker half run its tests. The connector itself always needs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorMetadata,
            KVConnectorWorkerMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    except ImportError:

        class KVConnectorMetadata:
            """Stand-in for vLLM's scheduler -> worker metadata base (vLLM absent)."""

        class KVConnectorWorkerMetadata:
            """Stand-in for vLLM's worker -> scheduler metadata base (vLLM absent)."""

        @dataclass
        class KVConnectorStats:
            """Stand-in for vLLM's connector stats base (vLLM absent)."""

            data: dict[str, Any] = field(default_factory=dict)

            def to_dict(self) -> dict[str, Any]:
                return self.data


__all__ = ["KVConnectorMetadata", "KVConnectorStats", "KVConnectorWorkerMetadata"]
