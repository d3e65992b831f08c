"""vLLM's real scheduler with the real connector halves, without a model: an engine in
one thread.

Each :class:`Engine` is vLLM 0.32's ``Scheduler`` (block allocation, prefix cache,
async loads, delayed frees, preemption: vLLM's code) with ``OmniKVConnector`` as its
connector, plus the connector's worker half over host caches in vLLM's CPU layout,
stepped through V1's ``KVConnectorModelRunnerMixin`` sequence (``runner="v1"``) or the V2
model runner's ``ActiveKVConnector`` (``runner="v2"``: vLLM's default on CUDA; it registers
the caches, binds metadata in ``pre_forward`` and starts loads after the forward in
``post_forward``, with no attention metadata). The forward pass writes
nothing: the caches start random, so after a transfer the consumer's blocks must hold
exactly the producer's bytes (compared token by token with the independent extraction
of ``_kv_fixtures.reference_kv``). Transfers use the real shm backend in their own
namespace. Start-up is about a second after the first (vLLM's imports).

Every call order vLLM 0.33 uses: ``runner="v1-spec"`` / ``"v2-spec"`` step with a
speculator (the step's results taken first, an emulated draft model writing the last
layer's KV of the scheduled tokens with the metadata bound, then the saves: vLLM's
deferred finalize); :meth:`Engine.overlapped` keeps two steps in flight, so
``update_state_after_alloc`` of an async load comes a step late, or never when the
request is freed first; ``late=True`` delivers each step's worker output to the
scheduler a step late (the output aggregator's replay of a failed worker's output).

``hybrid=True`` builds a tiny Gemma 3-shaped cache instead, as vLLM's hybrid KV cache
manager lays it out: layers 0 and 2 attend to a sliding window of ``WINDOW`` tokens
(KV cache group 0), layers 1 and 3 to every token (group 1); the layers of the two
groups alias one tensor each (layers 0 and 1, layers 2 and 3), over a shared pool of
``HYBRID_BLOCKS`` blocks.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from copy import copy
from pathlib import Path
from typing import Any

import torch
from _kv_fixtures import BS, DIM, HEADS, LAYERS, NBLOCKS, cpu_layout_cache, reference_kv
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from vllm_omni_kv.connector.omni_kv_connector import OmniKVConnector
from vllm_omni_kv.testing.kv_agent import kv_agent as agent
from vllm_omni_kv.testing.v2_calls import V2SpecCallsOmniKVConnector

TOKEN = 7  # what the emulated model samples
WINDOW = 64  # the hybrid cache's sliding window (tokens)
HYBRID_BLOCKS = 40
HYBRID_LAYERS = 4
#: the hybrid cache's layers: KV cache group 0 (sliding window), group 1 (full)
SLIDING, FULL = (0, 2), (1, 3)
#: the model runners' connector call sequences (vLLM 0.32: V2 is the CUDA default)
RUNNERS = ["v1", "v2"]
#: ... with a speculator: saves deferred past the step's results and the draft model
SPEC_RUNNERS = ["v1-spec", "v2-spec"]
#: vLLM >= 0.33: V2's ``post_forward(..., defer_finalize=True)`` and ``finalize_step``;
#: vLLM 0.32's V2 runner has no such order, V2SpecCallsOmniKVConnector emulates it there
V2_DEFERS = "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters
#: vLLM >= 0.33 defers async loads' ``update_state_after_alloc`` (overlapping steps)
DEFERS_LOADS = hasattr(Scheduler, "_drain_deferred_loads")
#: vLLM >= 0.33 replays a failed worker's connector output at the next aggregation
REPLAYS = hasattr(KVOutputAggregator, "ft_defer_kv_connector_outputs")


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_cache_config(hybrid: bool) -> KVCacheConfig:
    """One full-attention group of ``LAYERS`` layers, or the hybrid groups."""
    kw: dict[str, Any] = dict(block_size=BS, num_kv_heads=HEADS, head_size=DIM,
                              dtype=torch.bfloat16)  # fmt: skip
    if not hybrid:
        group = KVCacheGroupSpec([_name(i) for i in range(LAYERS)], FullAttentionSpec(**kw))
        return KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])
    groups = [
        KVCacheGroupSpec(
            [_name(i) for i in SLIDING], SlidingWindowSpec(**kw, sliding_window=WINDOW)
        ),
        KVCacheGroupSpec([_name(i) for i in FULL], FullAttentionSpec(**kw)),
    ]
    return KVCacheConfig(num_blocks=HYBRID_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _config(model_dir: Path, role: str, ns: str, extra: dict[str, Any], nblocks: int) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_connector_module_path="vllm_omni_kv.connector.omni_kv_connector",
        kv_role=role,
        engine_id=f"{role}-{ns}",
        kv_connector_extra_config={
            "backend": "shm",
            "backend_extra": {"namespace": ns},
            "recv_timeout": 10,
            "transfer_cpus": "inherit",
            **extra,
        },
    )
    max_len = nblocks * BS
    mc = ModelConfig(model=str(model_dir), max_model_len=max_len, skip_tokenizer_init=True)
    sc = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_len,
        max_model_len=max_len,
        is_encoder_decoder=False,
    )
    cfg = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=ktc,
    )
    cfg.cache_config.num_gpu_blocks = nblocks
    return cfg


class Engine:
    """One engine: vLLM's scheduler and the connector's worker half over host caches."""

    def __init__(
        self,
        model_dir: Path,
        role: str,
        ns: str,
        seed: int,
        hybrid: bool = False,
        runner: str = "v1",
        late: bool = False,
        **extra: Any,
    ) -> None:
        kv_config = kv_cache_config(hybrid)
        self.nblocks = kv_config.num_blocks
        self.config = _config(model_dir, role, ns, extra, self.nblocks)
        #: each layer's KV cache group, and the tensor it lives in
        self.group = {n: g for g, grp in enumerate(kv_config.kv_cache_groups)
                      for n in grp.layer_names}  # fmt: skip
        n_layers = HYBRID_LAYERS if hybrid else LAYERS
        names = [_name(i) for i in range(n_layers)]
        tensor_of = [i // 2 if hybrid else i for i in range(n_layers)]  # hybrid: pairs alias
        self.sched = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BS,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as vLLM's engine core does
        self.hasher = get_request_block_hasher(BS, hash_fn)
        #: the draft model's writes land between the step's results and its saves
        self.drafts = runner == "v1-spec" or (runner == "v2-spec" and V2_DEFERS)
        emulated = runner == "v2-spec" and not V2_DEFERS
        cls = V2SpecCallsOmniKVConnector if emulated else OmniKVConnector
        self.worker = cls(self.config, KVConnectorRole.WORKER, kv_config)
        self.caches = self._allocate(names, tensor_of, seed)
        self.active: ActiveKVConnector | None = None
        self.late = KVOutputAggregator(1) if late else None
        self._late_out: KVConnectorOutput | None = None  # vLLM 0.32: held a step here
        self.spans: dict[str, tuple[int, int]] = {}  # tokens each request computes now
        if runner.startswith("v2"):  # V2's runner registers the caches (ActiveKVConnector)
            with agent(self.worker):
                self.active = ActiveKVConnector(self.config, self.caches)
            self.buffers = InputBuffers(16, 4096, torch.device("cpu"))
        else:
            self.worker.register_kv_caches(self.caches)
        self.blocks: dict[str, list[int]] = {}  # each request's block table, last seen
        self.tables: dict[str, list[list[int]]] = {}  # ... of every KV cache group
        self.finished: dict[str, dict[str, Any] | None] = {}  # kv_transfer_params out
        self.sent: set[str] = set()  # requests reported in finished_sending
        self.reasons: dict[str, Any] = {}  # each finished request's FinishReason

    def _allocate(
        self, names: list[str], tensor_of: list[int], seed: int
    ) -> dict[str, torch.Tensor]:
        """Random caches; layer ``i`` is a view of tensor ``tensor_of[i]``."""
        n = max(tensor_of) + 1
        srcs = [cpu_layout_cache(i, seed=seed, nblocks=self.nblocks) for i in range(n)]
        pool = self.worker.get_mem_pool_context()
        views = srcs
        if pool is not None:
            per = srcs[0].numel() * srcs[0].element_size()
            with pool:  # as vLLM allocates the cache: one int8 tensor in the region
                buf = torch.zeros(per * n, dtype=torch.int8)
            views = [
                buf[i * per : (i + 1) * per].view(s.dtype).view(s.shape) for i, s in enumerate(srcs)
            ]
            for v, s in zip(views, srcs, strict=True):
                v.copy_(s)
        return {name: views[t] for name, t in zip(names, tensor_of, strict=True)}

    def add(self, req_id: str, prompt: list[int], params: dict[str, Any]) -> Request:
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        req = Request(req_id, list(prompt), sp, None, block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        so = self._schedule()
        self._update(so, self._execute(so))
        return so

    def overlapped(self, admit: Callable[[], None], between: Callable[[], None]) -> None:
        """Two steps in flight, as with async scheduling: step A is scheduled (it must
        compute tokens), ``admit()`` adds requests, step B is scheduled before A's output
        is processed, then ``between()`` runs (an abort), then A and B run. vLLM 0.33
        calls ``update_state_after_alloc`` of the async loads B admits once A's output is
        processed (never for a request freed before); 0.32 calls it at admission, and the
        harness defers it the same way (``_drain_deferred_loads``)."""
        if DEFERS_LOADS:  # what a consumer with overlapping steps and HiSparse sets
            self.sched.defer_block_free = self.sched.defer_async_loads = True
        so_a = self._schedule()
        assert so_a.total_num_scheduled_tokens > 0, "step A computes nothing"
        admit()
        conn, stash = self.sched.connector, list[tuple[Request, int]]()
        assert conn is not None
        if not DEFERS_LOADS:
            conn.update_state_after_alloc = lambda req, blocks, n: stash.append((req, n))  # type: ignore[method-assign]
        try:
            so_b = self._schedule()
        finally:
            conn.__dict__.pop("update_state_after_alloc", None)
        between()
        self._update(so_a, self._execute(so_a))
        for req, n in stash:
            if not req.is_finished():
                blocks = self.sched.kv_cache_manager.get_blocks(req.request_id)
                conn.update_state_after_alloc(req, blocks, n)
        self._update(so_b, self._execute(so_b))

    def _schedule(self) -> SchedulerOutput:
        so = self.sched.schedule()
        for rid, req in self.sched.requests.items():
            if rid in so.num_scheduled_tokens or req.num_computed_tokens:
                tables = self.sched.kv_cache_manager.get_block_ids(rid)
                self.tables[rid] = [list(t) for t in tables]
                self.blocks[rid] = self.tables[rid][0]
        for rid, n in so.num_scheduled_tokens.items():
            end = self.sched.requests[rid].num_computed_tokens
            self.spans[rid] = (end - n, end)
        return so

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with agent(self.worker):
            if so.total_num_scheduled_tokens == 0 and self.active is not None:
                return self.active.no_forward(so)
            if so.total_num_scheduled_tokens == 0:
                return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.config)
            return self._forward(so)

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        out = self._replay(out) if self.late is not None else out
        kv_out = out.kv_connector_output
        if kv_out is not None and kv_out.finished_sending:
            self.sent |= set(kv_out.finished_sending)
        outputs = self.sched.update_from_output(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.kv_transfer_params
                    self.reasons[o.request_id] = o.finish_reason

    def _replay(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """This step's worker output reaches the scheduler with the next step's (vLLM
        0.33: its aggregator replays it; 0.32: held here)."""
        assert self.late is not None
        out = copy(out)
        now, out.kv_connector_output = out.kv_connector_output, None
        if not REPLAYS:
            out.kv_connector_output, self._late_out = self._late_out, now
            return out
        merged = self.late.aggregate([out])
        assert merged is not None
        self.late.ft_defer_kv_connector_outputs([now])
        return merged

    def _connector_output(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        """The connector calls of a step with a forward pass, which writes nothing."""
        attn = {name: object() for name in self.caches}
        n = so.total_num_scheduled_tokens
        ids = list(so.num_scheduled_tokens)
        if self.active is None:  # V1: preemptions first, the output context in the forward's
            self.worker.handle_preemptions(so.kv_connector_metadata)
            if self.drafts:
                return self._spec_connector_output(so, attn)
            with (
                set_forward_context(attn, self.config, num_tokens=n),
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out,
            ):
                pass
            return kv_out
        batch = InputBatch.make_dummy(len(ids), n, self.buffers)
        with set_forward_context(attn, self.config, num_tokens=n):  # V2 (eager)
            self.active.pre_forward(so, dataclasses.replace(batch, req_ids=ids))
        self.active.finish_forward()
        if not self.drafts:
            return self.active.post_forward(so.finished_req_ids)
        kv_out = self.active.post_forward(so.finished_req_ids, defer_finalize=True)  # type: ignore[call-arg]
        self._draft(so)
        self.active.finalize_step()  # type: ignore[attr-defined]
        return kv_out

    def _spec_connector_output(self, so: SchedulerOutput, attn: Any) -> KVConnectorOutput | None:
        """V1 with a speculative config: finalized after the draft model (vLLM's code)."""
        mixin = KVConnectorModelRunnerMixin
        n = so.total_num_scheduled_tokens
        with (
            set_forward_context(attn, self.config, num_tokens=n),
            mixin.maybe_get_kv_connector_output(so, defer_finalize=True) as kv_out,
        ):
            pass
        self._draft(so)
        mixin.finalize_kv_connector()
        return kv_out

    def _draft(self, so: SchedulerOutput) -> None:
        """The draft model writes the last layer's K and V of every token this step
        computes, a function of the token and its position (the same on every engine)."""
        name = list(self.caches)[-1]
        cache = self.caches[name]
        nb, heads, bs, two_d = cache.shape
        d = two_d // 2  # K transposed ([d, bs]) then V ([bs, d]) per block and head
        k = cache.view(nb, heads, 2, d * bs)[:, :, 0].view(nb, heads, d, bs)
        v = cache.view(nb, heads, 2, bs * d)[:, :, 1].view(nb, heads, bs, d)
        for rid in so.num_scheduled_tokens:
            tokens = self.sched.requests[rid].all_token_ids
            table = self.tables[rid][self.group[name]]
            start, end = self.spans[rid]
            for t in range(start, min(end, len(tokens))):
                value = ((int(tokens[t]) * 31 + t) % 97) / 8
                block, off = table[t // bs], t % bs
                k[block, :, :, off] = value
                v[block, :, off] = -value

    def _forward(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        kv_out = self._connector_output(so)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([TOKEN] if done else [])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def run_until(self, done: Any, timeout: float = 20.0) -> None:
        """Step until ``done()`` holds (idle steps wait for transfers, as vLLM's do)."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the engine did not get there in time"
            self.step()

    def kv(self, req_id: str, start: int, end: int, group: int | None = None) -> list[torch.Tensor]:
        """K and V of tokens ``[start, end)`` of ``req_id`` in every layer (of ``group``),
        read through the layer's group's block table."""
        got = []
        for name, cache in self.caches.items():
            g = self.group[name]
            if group is None or g == group:
                k, v = reference_kv(cache, self.tables[req_id][g], end)
                got += [k[start:end], v[start:end]]
        return got

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def prefill(prod: Engine, rid: str, prompt: list[int]) -> dict[str, Any]:
    """The producer prefills ``rid``; the ``kv_transfer_params`` it hands a consumer."""
    prod.add(rid, prompt, {"do_remote_decode": True})
    prod.run_until(lambda: rid in prod.finished)
    params = prod.finished[rid]
    assert params is not None and params["do_remote_prefill"], params
    return params


def decode(
    prod: Engine, cons: Engine, rid: str, prompt: list[int], params: dict[str, Any]
) -> dict[str, Any]:
    """The consumer runs ``rid`` with ``params`` (the producer steps until its blocks go
    back); the request's ``omni_kv_load``."""
    cons.add(rid, prompt, dict(params))
    cons.run_until(lambda: rid in cons.finished)
    prod.run_until(lambda: rid in prod.sent)
    out = cons.finished[rid]
    assert out is not None
    return dict(out["omni_kv_load"])


def abort_while_loading(
    prod: Engine, cons: Engine, rid: str, prompt: list[int], num_blocks: int
) -> None:
    """vLLM aborts ``rid`` while its load is in flight: the consumer's blocks all go back
    (``num_blocks`` in its pool, the null block aside), the producer's payload is
    released and its blocks go back too."""
    params = prefill(prod, rid, prompt)
    cons.add(rid, prompt, dict(params))
    cons.step()  # the load is scheduled: the request waits for its remote KV
    assert cons.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    cons.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    pool = cons.sched.kv_cache_manager.block_pool
    free = num_blocks - 1
    cons.run_until(lambda: not cons.sched.requests and pool.get_num_free_blocks() == free)
    prod.run_until(lambda: rid in prod.sent)
    assert prod.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free
