"""vLLM ``KVConnectorBase_V1`` implementation: ``OmniKVConnector``.

Import :class:`~vllm_omni_kv.connector.omni_kv_connector.OmniKVConnector` from
its module; this package stays import-light (vLLM is loaded only there).
"""

from __future__ import annotations

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME"]

#: the name ``kv_transfer_config.kv_connector`` uses, and the class name in CONNECTOR_MODULE
CONNECTOR_NAME = "OmniKVConnector"
CONNECTOR_MODULE = "vllm_omni_kv.connector.omni_kv_connector"
