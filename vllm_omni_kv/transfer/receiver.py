"""The receive side of :class:`OmniKVTransferManager`: sender info, polling, layer-wise
parts, heterogeneous-TP merge/slice, and injection straight into a paged cache."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.errors import ConfigError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.extract import inject_streamed_kv
from vllm_omni_kv.transfer.kv_config import OmniKVCacheConfig
from vllm_omni_kv.transfer.kv_utils import (
    KVTPTopology,
    LayerKV,
    build_rank_aware_recv_keys,
    kv_zmq_port,
    merge_received_rank_shards,
    slice_received_rank_shard,
)
from vllm_omni_kv.transfer.parts import LAYER_START, iter_parts, join_parts, part_layer_count
from vllm_omni_kv.transfer.raw_blocks import (
    blocks_to_tokens,
    inject_streamed_blocks,
    is_block_payload,
)
from vllm_omni_kv.transfer.stream import PayloadStream

logger = init_logger(__name__)


class KVReceiver:
    """Receive-side methods mixed into ``OmniKVTransferManager`` (which provides the rest)."""

    config: OmniKVCacheConfig
    recv_stages: tuple[str | None, str | None]
    kv_recv_key_builder: Callable | None
    kv_payload_merger: Callable | None
    kv_payload_slicer: Callable | None
    _connector: OmniConnectorBase | None
    _sender_base: tuple[str, int] | None
    if TYPE_CHECKING:

        @property
        def connector(self) -> OmniConnectorBase: ...

        @property
        def local_rank(self) -> int: ...

        def topology(self, *, sending: bool) -> KVTPTopology: ...

    def update_sender_info(
        self, sender_info: dict[Any, Any], sender_stage_id: str | int | None = None
    ) -> None:
        """Record the sender's host and rank-0 ZMQ port (offset per TP rank on use)."""
        info = sender_info
        if sender_stage_id is not None and isinstance(sender_info.get(sender_stage_id), dict):
            info = sender_info[sender_stage_id]
        elif sender_stage_id is not None and isinstance(
            sender_info.get(str(sender_stage_id)), dict
        ):
            info = sender_info[str(sender_stage_id)]
        host = info.get("host") or info.get("sender_host")
        port = info.get("zmq_port") or info.get("sender_zmq_port") or info.get("port")
        if not host or port is None:
            raise ConfigError(f"sender_info needs 'host' and 'zmq_port', got keys {sorted(info)}")
        self._sender_base = (str(host), int(port))
        if self._connector is not None:
            self._push_sender_info()

    def _rank_port(self, rank: int) -> int:
        assert self._sender_base is not None
        return self._sender_base[1] + kv_zmq_port(0, 0, rank, 0) - kv_zmq_port(0, 0, 0, 0)

    def _push_sender_info(self) -> None:
        conn = self._connector
        if conn is None or self._sender_base is None or not hasattr(conn, "update_sender_info"):
            return
        topo = self.topology(sending=False)
        rank = self.local_rank if not topo.is_heterogeneous else 0
        conn.update_sender_info(self._sender_base[0], self._rank_port(rank))

    def _rank_metadata(self, from_rank: int | None) -> dict[str, Any] | None:
        if from_rank is None or self._sender_base is None:
            return None
        return {"source_host": self._sender_base[0], "source_port": self._rank_port(from_rank)}

    def _poll(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        meta: Any,
        deadline: float,
        max_delay: float | None = None,
        fetch: Callable[..., Any] | None = None,
    ) -> Any:
        """``fetch`` (default: the connector's ``get``) until it returns something or
        ``deadline`` passes (then None), backing off up to ``max_delay``."""
        fetch = fetch or self.connector.get
        cap = self.config.poll_interval if max_delay is None else max_delay
        delay = min(0.0002, cap)
        while True:
            got = fetch(from_stage, to_stage, key, meta)
            if got is not None:
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, cap)

    def _parts(
        self, key: str, from_rank: int | None, deadline: float
    ) -> Iterator[tuple[dict[str, Any], int]]:
        """The parts under ``key``, each complete and verified (later parts polled tightly).

        Parts are opened as streams, so a frame still being written is checksummed
        while it arrives instead of in a second pass; tensors stay zero-copy views.
        """
        for stream, size in self._part_streams(key, from_rank, deadline):
            with stream:
                for _ in stream.ready(deadline):
                    pass
                obj = stream.obj
            yield obj, size

    def _part_streams(
        self, key: str, from_rank: int | None, deadline: float
    ) -> Iterator[tuple[PayloadStream, int]]:
        """The parts under ``key`` as streams; later parts are in flight, so they are
        polled tightly. Each stream is opened only after the previous one was used."""
        from_stage, to_stage = self.recv_stages
        assert from_stage is not None and to_stage is not None
        meta = self._rank_metadata(from_rank)
        conn = self.connector

        def poll(k: str, first: bool) -> tuple[PayloadStream, int] | None:
            cap = self.config.poll_interval if first else min(self.config.poll_interval, 0.001)
            s = self._poll(
                from_stage, to_stage, k, meta, deadline, max_delay=cap, fetch=conn.open_stream
            )
            return None if s is None else (s, s.size)

        return iter_parts(poll, key, obj_of=lambda s: s.obj, discard=lambda s: s.close())

    def _receive_key(
        self, key: str, from_rank: int | None, deadline: float
    ) -> tuple[dict[str, Any], int] | None:
        try:
            got = list(self._parts(key, from_rank, deadline))
        except KVTransferTimeout as e:
            logger.warning("incomplete KV for key %s: %s", key, e)
            return None
        if not got:
            return None
        return join_parts([p for p, _ in got]), sum(n for _, n in got)

    def receive_kv_cache_for_request(
        self, request_id: str, target_device: torch.device | None = None
    ) -> tuple[dict[str, Any] | None, int]:
        """Receive (and merge/slice for heterogeneous TP) one request's KV; ``(None, 0)`` on timeout.

        Corrupt payloads raise ``KVPayloadError``: waiting longer cannot fix them.
        """
        from_stage, to_stage = self.recv_stages
        if from_stage is None or to_stage is None:
            raise ConfigError(
                "receiving needs need_recv_cache, a source stage (engine_input_source or "
                "omni_from_stage) and stage_id"
            )
        topo = self.topology(sending=False)
        keys = build_rank_aware_recv_keys(
            request_id, from_stage, to_stage, topo, self.kv_recv_key_builder
        )
        deadline = time.monotonic() + float(self.config.recv_timeout)
        payloads: list[dict[str, Any]] = []
        total = 0
        for key, from_rank in keys:
            got = self._receive_key(key, from_rank, deadline)
            if got is None:
                logger.warning(
                    "no KV for request %s (key %s) within %.1fs",
                    request_id,
                    key,
                    self.config.recv_timeout,
                )
                return None, 0
            obj, size = got
            payloads.append(blocks_to_tokens(obj) if is_block_payload(obj) else obj)
            total += size
        data: dict[str, Any] | None
        if len(payloads) > 1:
            data = merge_received_rank_shards(payloads, merger=self.kv_payload_merger)
        else:
            data = payloads[0]
        if topo.target_tp_size > topo.source_tp_size:
            data = slice_received_rank_shard(data, topo, slicer=self.kv_payload_slicer)
        if data is not None:
            data = _trim_to_num_tokens(data)
        if data is not None and target_device is not None:
            data = _to_device(data, target_device)
        return data, total

    def receive_kv_cache_into(
        self,
        request_id: str,
        kv_caches: list[LayerKV | None],
        block_ids: list[int],
        *,
        layout: str | None = None,
    ) -> tuple[int, int] | None:
        """Receive one request's KV straight into a local paged cache, part by part.

        Each layer-wise part is verified and written into blocks ``block_ids`` as
        soon as it arrives, while the sender packs the next one; with a streaming
        backend (shared memory) block-format payloads are written block by block
        while the sender is still packing them. Returns ``(tokens, bytes)``, or
        None on timeout; then, and after any exception, the blocks may hold a
        partial payload: do not use them. Needs a homogeneous TP topology (one source
        key); use :meth:`receive_kv_cache_for_request` to merge/slice shards.
        """
        from_stage, to_stage = self.recv_stages
        if from_stage is None or to_stage is None:
            raise ConfigError("receiving needs need_recv_cache, a source stage and stage_id")
        topo = self.topology(sending=False)
        keys = build_rank_aware_recv_keys(
            request_id, from_stage, to_stage, topo, self.kv_recv_key_builder
        )
        if len(keys) != 1 or topo.is_heterogeneous:
            raise ConfigError(
                "receive_kv_cache_into needs equal source and target TP sizes; "
                "use receive_kv_cache_for_request for heterogeneous TP"
            )
        key, from_rank = keys[0]
        deadline = time.monotonic() + float(self.config.recv_timeout)
        tokens, total, seen = -1, 0, False
        try:
            for stream, size in self._part_streams(key, from_rank, deadline):
                seen = True
                with stream:
                    part = stream.obj
                    start = int((part.get("metadata") or {}).get(LAYER_START, 0))
                    local = kv_caches[start : start + part_layer_count(part)]
                    if is_block_payload(part):
                        del part
                        n = inject_streamed_blocks(
                            stream, cast(Any, local), block_ids, deadline, layout=layout
                        )
                    else:
                        del part
                        n = inject_streamed_kv(stream, local, block_ids, deadline, layout=layout)
                tokens = n if tokens < 0 else min(tokens, n)
                total += size
        except KVTransferTimeout as e:
            logger.warning("incomplete KV for request %s: %s", request_id, e)
            return None
        if not seen:
            logger.warning(
                "no KV for request %s within %.1fs", request_id, self.config.recv_timeout
            )
            return None
        return max(tokens, 0), total


def _map_layer_tensors(data: dict[str, Any], fn: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """``data`` with ``fn`` applied to every tensor of its per-layer lists."""
    blocks = {
        name: [fn(t) if isinstance(t, torch.Tensor) else t for t in layers]
        if isinstance(layers, list)
        else layers
        for name, layers in data.get("layer_blocks", {}).items()
    }
    return {**data, "layer_blocks": blocks}


def _trim_to_num_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """Producers may ship whole blocks; keep the first ``metadata.num_tokens`` rows (views)."""
    n = (data.get("metadata") or {}).get("num_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return data
    return _map_layer_tensors(data, lambda t: t[:n] if t.shape[0] > n else t)


def _to_device(data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return _map_layer_tensors(data, lambda t: t.to(device))
