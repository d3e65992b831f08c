"""vLLM general-plugin entry point: registers ``OmniKVConnector`` lazily."""

from __future__ import annotations

from vllm_omni_kv.connector import CONNECTOR_MODULE, CONNECTOR_NAME

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]


def register() -> bool:
    """Register the connector with vLLM's ``KVConnectorFactory``.

    Only the module path is recorded; the connector module is imported by vLLM
    when a ``kv_transfer_config`` names it. Safe to call any number of times.
    Returns True when this call added the registration.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent: nothing to register with.
        return False
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    return True
