"""Scheduler half of :class:`OmniKVConnector`: which requests save, load or discard KV.

Protocol (NIXL's, so existing proxies and routers work unchanged):

* producer: a request carrying ``kv_transfer_params={"do_remote_decode": True}``
  is saved in the step that completes its prefill; ``request_finished`` keeps
  its blocks (``delay_free=True``) until the worker reports it in
  ``finished_sending`` and returns the params the consumer needs
  (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``...).
* consumer: a request carrying those params loads every prompt token not
  cached locally, asynchronously (``get_num_new_matched_tokens`` returns
  ``(n, True)``); only those tokens cross the transport. The worker reports it in
  ``finished_recving`` (and its blocks as invalid when the load failed, so vLLM
  recomputes or fails it according to ``kv_load_failure_policy``). When every
  block but the last is cached locally, nothing is loaded: the consumer computes
  the rest itself and tells the producer to release its payload. While such a
  request waits for blocks, the scheduler asks the worker every
  ``extend_every(send_ttl)`` seconds to extend its payload's lease at the producer
  (see :mod:`.handoff`), so a long queue does not let it expire. vLLM 0.33 may call
  ``update_state_after_alloc`` steps after admitting the request (steps in flight), or
  never (the request freed first: ``request_finished`` releases the payload).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm_omni_kv.connector.config import OmniKVConfig
from vllm_omni_kv.connector.handoff import extend_every
from vllm_omni_kv.connector.kv_groups import (
    kept_blocks,
    main_group,
    save_tables,
    transfer_group_count,
    transfer_tables,
)
from vllm_omni_kv.connector.metadata import (
    LoadSpec,
    OmniKVConnectorMetadata,
    OmniKVWorkerMetadata,
    RemotePayload,
    SaveSpec,
    merge_load,
    prompt_digest,
    transfer_id,
)
from vllm_omni_kv.connector.remote_params import (
    RemoteParams,
    RemoteParamsError,
    parse_remote_params,
)
from vllm_omni_kv.connector.state_layers import payload_tokens, state_backoff, truncate_for_save
from vllm_omni_kv.logger import LogBudget, init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
#: lines any client's request can cause
_per_request = LogBudget(logger)

#: ``omni_kv_load`` of a request whose prompt was cached here: nothing was pulled
LOCAL_HIT = {"ok": True, "tokens": 0, "bytes": 0, "seconds": 0.0, "error": "", "local_hit": True}


class OmniKVScheduler:
    """Bookkeeping in the scheduler process; no data moves here."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: OmniKVConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_cache_config = kv_cache_config
        # several transfer groups (vLLM's hybrid KV cache manager): block ids per group
        self.hybrid = transfer_group_count(kv_cache_config) > 1
        self.main = main_group(kv_cache_config)  # the group whose table is ``block_ids``
        # prompt tokens a consumer computes itself (1 with state layers, see .state_layers)
        self.backoff = state_backoff(kv_cache_config)
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.kv_cache_manager: KVCacheManager | None = None
        # producer: requests to save once their prefill completes
        self._to_save: dict[str, Request] = {}
        # producer: saves issued to the worker, until request_finished
        self._saved: dict[str, tuple[SaveSpec, Request]] = {}
        # consumer: loads to ship with the next metadata / in flight / outcomes
        self._new_loads: list[LoadSpec] = []
        self._loading: dict[str, LoadSpec] = {}
        self._load_results: dict[str, dict[str, Any]] = {}
        self._discards: list[RemotePayload] = []
        self._withdraws: list[str] = []  # saved requests aborted: their payload goes unread
        # consumer: requests served from the local prefix cache (payload released, not pulled)
        self._local_hits: set[str] = set()
        # consumer: requests that wait for blocks, whose payload leases are extended
        self._waiting: dict[str, RemotePayload] = {}
        # consumer: the local prefix (tokens) vLLM reported, where the external span starts
        self._local_prefix: dict[str, int] = {}
        self._next_extend = 0.0

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _wants_remote_prefill(request: Request) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        return params

    def _remote_params(self, request: Request, params: dict[str, Any]) -> RemoteParams | None:
        """The payload ``params`` name, if this consumer may load it (logs why not)."""
        try:
            remote = parse_remote_params(params, self.tp_size)
        except RemoteParamsError as e:
            _per_request.warning(
                "request %s: kv_transfer_params with do_remote_prefill are invalid (%s); its "
                "prompt is computed locally. Pass the kv_transfer_params the producer "
                "returned unchanged.",
                request.request_id,
                e,
            )
            return None
        if not self.cfg.trusted_producers.allows(remote.host, remote.port):
            _per_request.warning(
                "request %s: kv_transfer_params name producer %s:%s, which is not in "
                "kv_connector_extra_config.trusted_producers; its prompt is computed locally",
                request.request_id,
                remote.host,
                remote.port,
            )
            return None
        return remote

    @staticmethod
    def _remote(request: Request, remote: RemoteParams) -> RemotePayload:
        return RemotePayload(
            req_id=request.request_id,
            transfer_id=remote.transfer_id,
            source_tp_size=remote.tp_size,
            remote_host=remote.host,
            remote_port=remote.port,
        )

    # -- vLLM scheduler-side API ----------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self.is_producer and params and params.get("do_remote_decode"):
            truncate_for_save(request, self.backoff)
            self._to_save[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._wants_remote_prefill(request)
        if params is None or not self.is_consumer:
            return 0, False
        remote = self._remote_params(request, params)
        if remote is None:
            return 0, False
        # Every uncomputed token is loaded, a part of one block included (as vLLM's
        # NixlConnector does): vLLM recomputes only the prompt's last token after a load.
        # The external span starts right after the local prefix vLLM reports here.
        self._local_prefix[request.request_id] = int(num_computed_tokens)
        count = payload_tokens(int(request.num_prompt_tokens), self.backoff)
        count -= int(num_computed_tokens)
        if count <= 0:  # a local hit covers what the payload holds
            return 0, False
        if request.request_id not in self._waiting:  # until its blocks are allocated
            self._waiting[request.request_id] = self._remote(request, remote)
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._waiting.pop(request.request_id, None)
        local_prefix = self._local_prefix.pop(request.request_id, 0)
        params = self._wants_remote_prefill(request)
        if params is None or not self.is_consumer:
            return
        remote = self._remote_params(request, params)
        if remote is None:
            params["do_remote_prefill"] = False
            return
        num_prompt = payload_tokens(int(request.num_prompt_tokens), self.backoff)
        if 0 < num_external_tokens <= num_prompt - local_prefix:
            tables = transfer_tables(self.kv_cache_config, blocks.get_block_ids())
            spec = LoadSpec(
                req_id=request.request_id,
                transfer_id=remote.transfer_id,
                block_ids=tables[self.main],
                group_block_ids=tables if self.hybrid else None,
                num_local_tokens=local_prefix,
                num_load_tokens=int(num_external_tokens),
                num_prompt_tokens=num_prompt,
                prompt_digest=prompt_digest((request.prompt_token_ids or [])[:num_prompt]),
                source_tp_size=remote.tp_size,
                remote_host=remote.host,
                remote_port=remote.port,
            )
            self._new_loads.append(spec)
            self._loading[request.request_id] = spec
        else:
            # vLLM asked for nothing external (its local hit covers what the payload
            # holds): release the producer's copy.
            self._discards.append(self._remote(request, remote))
            if local_prefix > 0:
                self._local_hits.add(request.request_id)
        # One transfer per request, even if it is preempted and rescheduled later.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OmniKVConnectorMetadata:
        meta = OmniKVConnectorMetadata(
            idle=int(scheduler_output.total_num_scheduled_tokens) == 0,
            loads=self._new_loads,
            discards=self._discards,
            withdraws=self._withdraws,
        )
        self._new_loads, self._discards, self._withdraws = [], [], []
        if self._waiting and (now := time.monotonic()) >= self._next_extend:
            meta.extends = list(self._waiting.values())
            self._next_extend = now + extend_every(self.cfg.send_ttl)
        self._resave_preempted(scheduler_output, meta)
        if self._to_save:
            block_state = getattr(scheduler_output, "kv_connector_block_state", None)
            for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
                request = self._to_save.get(req_id)
                if request is None:
                    continue
                n_prompt = int(request.num_prompt_tokens)
                if int(request.num_computed_tokens) + int(n_sched) < n_prompt:
                    continue  # a chunk of a longer prefill: save with its last chunk
                groups = block_state.get_block_ids(req_id) if block_state is not None else None
                if groups is None and self.kv_cache_manager is not None:
                    groups = self.kv_cache_manager.get_block_ids(req_id)
                if groups is None:
                    logger.error("request %s: no block table to save its KV from", req_id)
                    continue
                spec = self._save_spec(request, groups)
                meta.saves.append(spec)
                self._saved[req_id] = (spec, request)
                del self._to_save[req_id]
        return meta

    def _save_spec(self, request: Request, groups: tuple[list[int], ...]) -> SaveSpec:
        """The save of ``request``'s prompt from its blocks ``groups`` (one list per KV
        cache group): with several groups, only the blocks each group's consumer keeps."""
        n_prompt = int(request.num_prompt_tokens)
        n_blocks = -(-n_prompt // self.block_size)
        tables = None
        if self.hybrid:
            tables = save_tables(
                self.kv_cache_config, self.kv_cache_manager, groups, n_prompt, self.block_size
            )
        return SaveSpec(
            req_id=request.request_id,
            transfer_id=transfer_id(self.engine_id, request.request_id),
            block_ids=list(groups[0][:n_blocks]) if tables is None else tables[self.main],
            num_tokens=n_prompt,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            group_block_ids=tables,
        )

    def _resave_preempted(
        self, scheduler_output: SchedulerOutput, meta: OmniKVConnectorMetadata
    ) -> None:
        """vLLM preempted saved requests and freed their blocks: the worker voids their
        payloads (a one-copy payload names those blocks), and each is saved again once
        its prefill is recomputed."""
        for req_id in scheduler_output.preempted_req_ids or ():
            saved = self._saved.pop(req_id, None)
            if saved is not None:
                meta.preempted.append(req_id)
                self._to_save[req_id] = saved[1]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # TP ranks' outcomes of one load can come in different steps (a rank finished
        # later, or vLLM replays a failed worker's output a step late): merged, so a
        # failure on any rank stays one.
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, OmniKVWorkerMetadata):
            for req_id, res in wm.loads.items():
                if req_id in self._loading:
                    seen = self._load_results.get(req_id)
                    self._load_results[req_id] = res if seen is None else merge_load(seen, res)

    def request_finished(
        self, request: Request, block_ids: Sequence[Any] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (one list, or one per KV cache group); the
        payload names the blocks saved, which vLLM holds until ``finished_sending``."""
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._to_save.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._local_prefix.pop(req_id, None)
        saved = self._saved.pop(req_id, None)
        spec = None if saved is None else saved[0]
        if spec is not None:
            # The worker reports every saved request in finished_sending once it is
            # finished, so its blocks are held until then, whatever the outcome.
            if request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            ):
                self._withdraws.append(req_id)  # no consumer will come for it
                return True, None
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": req_id,
                "remote_transfer_id": spec.transfer_id,
                "remote_host": self.cfg.remote_host,
                "remote_port": self.cfg.remote_port,
                # one list per KV cache group (the blocks each keeps), as vLLM's connectors
                "remote_block_ids": kept_blocks(spec.tables()),
                "remote_num_tokens": spec.num_tokens,
                "tp_size": self.tp_size,
                "omni_from_stage": self.cfg.from_stage,
                "omni_to_stage": self.cfg.to_stage,
            }
        if req_id in self._local_hits:
            self._local_hits.discard(req_id)
            return False, {"omni_kv_load": dict(LOCAL_HIT)}
        load = self._loading.pop(req_id, None)
        if load is not None:
            res = self._load_results.pop(req_id, None)
            return False, {"omni_kv_load": res if res is not None else {"ok": False}}
        params = self._wants_remote_prefill(request)
        remote = None
        if params is not None and self.is_consumer:
            remote = self._remote_params(request, params)
        if params is not None and remote is not None:
            # Finished (aborted) before its blocks were allocated: drop the payload.
            self._discards.append(self._remote(request, remote))
            params["do_remote_prefill"] = False
        return False, None
