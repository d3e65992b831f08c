"""Utility helpers for KV cache manipulation, TP routing, and merge/slice.

vllm-omni's ``kv_utils`` API, re-exported from the modules that hold each concept:
:mod:`.tp_routing`, :mod:`.rank_keys`, :mod:`.kv_ports`, :mod:`.worker_ranks`,
:mod:`.head_shards` and :mod:`.layouts`.

Nothing here imports vLLM at module import time: the rank helpers look vLLM
up lazily and fall back to single-process defaults outside a vLLM worker.
"""

from __future__ import annotations

from vllm_omni_kv.kvcache.head_shards import (
    merge_received_rank_shards,
    slice_kv_tensor_heads,
    slice_layer_blocks,
    slice_received_rank_shard,
)
from vllm_omni_kv.kvcache.kv_ports import (
    KV_ZMQ_MAX_STAGES,
    KV_ZMQ_MAX_TP_RANKS,
    KV_ZMQ_PORT_OFFSET,
    KV_ZMQ_RANK_STRIDE,
    KV_ZMQ_REPLICA_STRIDE,
    kv_zmq_port,
    sender_rank_port,
)
from vllm_omni_kv.kvcache.kv_views import (
    KV_LAYOUTS,
    LayerKV,
    detect_kv_layout,
    normalize_layer_kv,
)
from vllm_omni_kv.kvcache.rank_keys import (
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    get_kv_connector_key,
)
from vllm_omni_kv.kvcache.tp_routing import (
    KVTPTopology,
    get_kv_source_ranks,
    get_kv_target_ranks,
    validate_kv_tp_topology,
)
from vllm_omni_kv.kvcache.worker_ranks import (
    REPLICA_ID_ENV as REPLICA_ID_ENV,
)
from vllm_omni_kv.kvcache.worker_ranks import (
    get_local_tp_rank,
    get_omni_replica_id,
    get_tp_world_size,
)
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "KV_LAYOUTS",
    "KV_ZMQ_MAX_STAGES",
    "KV_ZMQ_MAX_TP_RANKS",
    "KV_ZMQ_PORT_OFFSET",
    "KV_ZMQ_RANK_STRIDE",
    "sender_rank_port",
    "KV_ZMQ_REPLICA_STRIDE",
    "KVTPTopology",
    "LayerKV",
    "build_rank_aware_recv_keys",
    "build_rank_aware_send_keys",
    "detect_kv_layout",
    "get_kv_connector_key",
    "get_kv_source_ranks",
    "get_kv_target_ranks",
    "get_local_tp_rank",
    "get_omni_replica_id",
    "get_tp_world_size",
    "kv_zmq_port",
    "merge_received_rank_shards",
    "normalize_layer_kv",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
    "validate_kv_tp_topology",
]
