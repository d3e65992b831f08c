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

With a speculator, vLLM 0.33's V2 runner calls ``post_forward(finished_req_ids,
defer_finalize=True)``: ``get_transfer_results``, ``get_block_ids_with_load_errors``, the
stats and ``build_connector_worker_meta`` run first, the draft model runs with the
metadata still bound, and ``finalize_step`` then calls ``wait_for_save`` and
``clear_connector_metadata`` (V1's runner defers the same way with a speculative config).
:class:`V2SpecCallsOmniKVConnector` gives any runner that order: the ``wait_for_save``
it is called with runs when the metadata is cleared, after the step's results were taken
(``"kv_connector": "V2SpecCallsOmniKVConnector"``, same module path).
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


class V2SpecCallsOmniKVConnector(V2CallsOmniKVConnector):
    """V2's order with a speculator: the step's results are taken before its saves, which
    run at ``clear_connector_metadata`` (``finalize_step``) with the metadata bound."""

    _save_due = False

    def wait_for_save(self) -> None:
        self._save_due = True

    def clear_connector_metadata(self) -> None:
        if self._save_due:
            self._save_due = False
            super().wait_for_save()
        super().clear_connector_metadata()
