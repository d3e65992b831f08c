"""OmniKVConnector driven in the order of vLLM's V2 model runner on a V1 runner (benchmarks).

vLLM 0.32 uses its V2 model runner on CUDA; the CPU build runs V1. V2's
``ActiveKVConnector`` (``vllm/v1/worker/gpu/kv_connector.py``) calls ``finish_forward``
after the forward, then ``start_load_kv`` under a forward context without attention
metadata (vLLM 0.32's V1 runner also starts loads after the forward unless a step has
synchronous loads, but under the forward's context; OmniKVConnector has no
``finish_forward``). :class:`V2CallsOmniKVConnector` makes the V1 runner's calls arrive
without attention metadata, so a ``vllm serve`` on CPU can measure the connector under
V2's call sequence (``benchmarks/pd_load.py``, configuration ``omnikv_shm_v2_calls``). Configure it with
``"kv_connector": "V2CallsOmniKVConnector"`` and
``"kv_connector_module_path": "vllm_omni_kv.testing.v2_calls"``.
"""

from __future__ import annotations

from typing import Any

from vllm.forward_context import ForwardContext, get_forward_context, set_forward_context

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector


class V2CallsOmniKVConnector(OmniKVConnector):
    """OmniKVConnector whose loads start as V2's ``post_forward`` starts them."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        with set_forward_context(None, self._vllm_config):
            super().start_load_kv(get_forward_context(), **kwargs)
