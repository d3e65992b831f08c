"""A connector as the process's KV transfer group, for tests that drive one by hand."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.distributed.kv_transfer import kv_transfer_state

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector


@contextmanager
def kv_agent(connector: OmniKVConnector) -> Iterator[None]:
    """``connector`` as the process's KV transfer group (what vLLM's worker sets up), the
    previous one back on exit."""
    before = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = before
