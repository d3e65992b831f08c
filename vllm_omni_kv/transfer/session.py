"""``TransferSession``: one edge ``from_stage -> to_stage`` over one backend.

The only implementation of what both clients (``OmniKVTransferManager`` and the
vLLM connector's worker half) need from a transport: rank-aware keys, where a
sender rank listens, bounded send retries, layer-wise parts, receive polling
with backoff, cancellation, and loading just the frame bytes a plan needs.
vLLM-free; the payload formats live in :mod:`vllm_omni_kv.kvcache`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import (
    ConfigError,
    KVPayloadError,
    KVTransferError,
    KVTransferTimeout,
)
from vllm_omni_kv.kvcache.formats import InjectionPlan
from vllm_omni_kv.kvcache.kv_utils import (
    KVTPTopology,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    sender_rank_port,
)
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.transfer.parts import (
    MAX_PARTS,
    iter_parts,
    join_parts,
    part_info,
    part_key,
    send_parts,
)
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.auth import AuthKey
from vllm_omni_kv.wire.stream import PayloadStream, check_cancel

logger = init_logger(__name__)

#: payloads above this many bytes travel as layer-wise parts over backends that
#: cannot stream a frame while it is being written (see ``transfer.parts``). In the
#: vLLM connector a consumer learns a payload's key only after the producer published
#: all of it, so parts overlap nothing there: what they do is bound a frame by a
#: fixed transfer pool (Mooncake TE / NIXL ``memory_pool_size``, Mooncake Store
#: segments), so a request larger than the pool still moves, part by part.
DEFAULT_MAX_PART_BYTES = 8 << 20
#: later parts of a payload are already in flight: poll them at most this far apart
PART_POLL_S = 0.001

#: ``plan(part, layer_start)``: the injection plan of one received part
PlanPart = Callable[[dict[str, Any], int], InjectionPlan]


@dataclass(frozen=True)
class SessionPolicy:
    """Timing and size settings of a :class:`TransferSession`.

    ``poll_interval`` is the first wait between polls for a payload that is not
    there yet; waits double up to ``max_poll_interval``. ``send_retries`` and
    ``retry_backoff`` bound the send retry loop. ``max_part_bytes``: payloads above
    it travel as layer-wise parts (0: never; None: automatic, one frame over a
    streaming backend, ``DEFAULT_MAX_PART_BYTES`` over the others).
    """

    poll_interval: float = 0.001
    max_poll_interval: float = 0.02
    send_retries: int = 3
    retry_backoff: float = 0.05
    max_part_bytes: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.poll_interval <= self.max_poll_interval <= 5:
            raise ConfigError(
                "poll_interval must be > 0 and <= max_poll_interval <= 5 seconds, got "
                f"{self.poll_interval!r} / {self.max_poll_interval!r}"
            )
        if self.send_retries < 1 or self.retry_backoff < 0:
            raise ConfigError("send_retries must be >= 1 and retry_backoff >= 0")
        if self.max_part_bytes is not None and self.max_part_bytes < 0:
            raise ConfigError("max_part_bytes must be >= 0 or null")


def sender_endpoint(
    host: str | None, rank0_port: int | None, from_rank: int | None
) -> dict[str, Any] | None:
    """Backend metadata addressing sender rank ``from_rank`` (rank 0 listens on ``rank0_port``)."""
    if not host or not rank0_port:
        return None
    return {"source_host": host, "source_port": sender_rank_port(rank0_port, from_rank or 0)}


class TransferSession:
    """Keys, sends and receives for one edge through ``backend``."""

    def __init__(
        self,
        backend: OmniConnectorBase,
        from_stage: str,
        to_stage: str,
        policy: SessionPolicy | None = None,
        *,
        send_key_hook: Callable | None = None,
        recv_key_hook: Callable | None = None,
        auth: AuthKey | None = None,
    ) -> None:
        """``auth``: the shared key; frames sent carry its MACs and every stream
        received is authenticated with it (without it, keyed frames are refused)."""
        self.backend = backend
        self.auth = auth
        self.from_stage = str(from_stage)
        self.to_stage = str(to_stage)
        self.policy = policy or SessionPolicy()
        self.send_key_hook = send_key_hook
        self.recv_key_hook = recv_key_hook

    @classmethod
    def open(
        cls,
        spec: ConnectorSpec,
        from_stage: str,
        to_stage: str,
        policy: SessionPolicy | None = None,
        *,
        auth: AuthKey | None = None,
    ) -> TransferSession:
        """A session over a new backend built from ``spec``."""
        backend = OmniConnectorFactory.create_connector(spec)
        return cls(backend, from_stage, to_stage, policy, auth=auth)

    # -- keys ----------------------------------------------------------------------------
    def send_keys(self, transfer_id: str, topo: KVTPTopology) -> list[str]:
        """One key per target rank this sender feeds."""
        return build_rank_aware_send_keys(
            transfer_id, self.from_stage, self.to_stage, topo, self.send_key_hook
        )

    def recv_keys(self, transfer_id: str, topo: KVTPTopology) -> list[tuple[str, int | None]]:
        """``(key, from_rank)`` per source rank this receiver reads, in rank order."""
        return build_rank_aware_recv_keys(
            transfer_id, self.from_stage, self.to_stage, topo, self.recv_key_hook
        )

    # -- send ----------------------------------------------------------------------------
    def part_limit(self) -> int:
        limit = self.policy.max_part_bytes
        if limit is None:
            limit = 0 if self.backend.supports_streaming else DEFAULT_MAX_PART_BYTES
        return limit

    def send(self, key: str, data: Any, *, chunk_bytes: int | None = None) -> int:
        """Publish ``data`` under ``key``; return bytes put (see :meth:`publish`)."""
        return self.publish(key, data, chunk_bytes=chunk_bytes)[0]

    def publish(self, key: str, data: Any, *, chunk_bytes: int | None = None) -> tuple[int, int]:
        """Publish ``data`` under ``key`` (as layer-wise parts when large); return
        ``(bytes put, parts)``.

        ``chunk_bytes`` sets the frame's verification chunk (one paged block lets a
        receiver verify exactly the blocks it reads). Raises ``KVPayloadError`` for a
        payload that cannot be framed and ``KVTransferError`` when the backend keeps
        refusing it after ``send_retries`` attempts.
        """
        total, parts = 0, 0

        def put(part_key: str, part: Any) -> bool:
            nonlocal total, parts
            total += self._put(part_key, codec.encode(part, chunk_bytes, self.auth))
            parts += 1
            return True

        send_parts(put, key, data, self.part_limit())
        return total, parts

    def _put(self, key: str, frame: codec.Frame) -> int:
        delay = self.policy.retry_backoff
        reason = ""
        for attempt in range(1, self.policy.send_retries + 1):
            try:
                ok, size, _meta = self.backend.put(self.from_stage, self.to_stage, key, frame)
                if ok:
                    return int(size)
                reason = "the backend refused the put"
            except KVPayloadError:
                raise  # the payload itself is bad: retrying cannot help
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
            if attempt < self.policy.send_retries:
                logger.warning(
                    "sending KV %s failed (%s); retry %d in %.2fs", key, reason, attempt, delay
                )
                time.sleep(delay * (1 + random.random() * 0.1))
                delay *= 2
        raise KVTransferError(
            f"sending KV {key!r} failed after {self.policy.send_retries} attempts: {reason}"
        )

    # -- receive -------------------------------------------------------------------------
    def _open(
        self,
        key: str,
        endpoint: dict[str, Any] | None,
        deadline: float,
        cancel: threading.Event | None,
        first_wait: float,
        max_wait: float,
    ) -> PayloadStream:
        """Poll ``open_stream`` with backoff until a stream, ``deadline`` or ``cancel``."""
        delay, last_err = first_wait, ""
        while True:
            check_cancel(cancel, f"waiting for KV {key!r}")
            try:
                stream = self.backend.open_stream(self.from_stage, self.to_stage, key, endpoint)
            except KVPayloadError:
                raise
            except KVTransferError as e:  # the backend's own wait ran out, a peer is slow...
                stream, last_err = None, f"{type(e).__name__}: {e}"
            if stream is not None:
                try:
                    stream.authenticate(self.auth)
                except BaseException:
                    stream.close()
                    raise
                return stream
            left = deadline - time.monotonic()
            if left <= 0:
                why = f" (last backend error: {last_err})" if last_err else ""
                raise KVTransferTimeout(
                    f"no KV payload under key {key!r} in time{why}; is the producer running and "
                    "using the same backend and stage names?"
                )
            wait = min(delay, left)
            if cancel is not None:
                cancel.wait(wait)
            else:
                time.sleep(wait)
            delay = min(delay * 2, max_wait)

    def open_parts(
        self,
        key: str,
        endpoint: dict[str, Any] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Iterator[PayloadStream]:
        """The streams of the payload under ``key``, part by part (one for a single frame).

        Each part is opened once the caller is done with the previous one; close
        each stream you are given (``with``). Raises ``KVTransferTimeout`` when a
        part does not arrive by ``deadline`` and ``KVTransferCancelled`` on cancel.
        """
        p = self.policy

        def poll(k: str, first: bool) -> tuple[PayloadStream, int] | None:
            if first:
                s = self._open(k, endpoint, deadline, cancel, p.poll_interval, p.max_poll_interval)
            else:
                cap = min(p.max_poll_interval, PART_POLL_S)
                s = self._open(k, endpoint, deadline, cancel, min(p.poll_interval, cap), cap)
            return s, s.size

        for stream, _size in iter_parts(
            poll, key, obj_of=lambda s: s.obj, discard=lambda s: s.close()
        ):
            yield stream

    def receive_into(
        self,
        key: str,
        endpoint: dict[str, Any] | None,
        deadline: float,
        plan: PlanPart,
        cancel: threading.Event | None = None,
    ) -> tuple[int, int]:
        """Receive the payload under ``key`` straight into a local cache.

        ``plan(part, layer_start)`` returns the injection plan of each part; only
        the frame bytes the plan needs are loaded, verified and written as they
        arrive. Returns ``(tokens, bytes moved)``. On any error the local blocks may
        hold part of the payload and must not be used.
        """
        tokens, moved = -1, 0
        for stream in self.open_parts(key, endpoint, deadline, cancel):
            with stream:
                info = part_info(stream.obj)
                injection = plan(stream.obj, 0 if info is None else info[2])
                n = injection.apply(stream, deadline, cancel)
                moved += stream.moved
            tokens = n if tokens < 0 else min(tokens, n)
        return max(tokens, 0), moved

    def fetch(
        self,
        key: str,
        endpoint: dict[str, Any] | None,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> tuple[dict[str, Any], int]:
        """The whole payload under ``key``, every byte loaded and verified, parts joined.

        Tensors are views that keep the received frames alive. Returns ``(payload,
        bytes moved)``.
        """
        parts: list[dict[str, Any]] = []
        moved = 0
        for stream in self.open_parts(key, endpoint, deadline, cancel):
            with stream:
                for _ in stream.load(None, deadline, cancel):
                    pass
                parts.append(stream.obj)
                moved += stream.moved
        return join_parts(parts), moved

    def discard(self, key: str, endpoint: dict[str, Any] | None) -> bool:
        """Tell the producer its payload under ``key`` (every part) will not be read.

        No payload bytes move. A sender publishes all parts before it reports the
        request sent, so the parts are discarded in order until one is absent.
        """
        found = False
        for i in range(MAX_PARTS):
            if not self.backend.discard(self.from_stage, self.to_stage, part_key(key, i), endpoint):
                break
            found = True
        return found

    # -- the vLLM connector's port onto the backend ----------------------------------------
    @property
    def cache_region(self) -> CacheRegion | None:
        """The backend's exportable KV cache region (one-copy sends), if it has one."""
        return self.backend.cache_region

    @property
    def verifies_frames(self) -> bool:
        return self.backend.verify

    def transport(self) -> str:
        """What carries this session's bytes (the backend's :meth:`transport`)."""
        return self.backend.transport()

    def endpoint(self) -> tuple[str, int] | None:
        """``(host, port)`` of the side channel consumers address, if the backend serves one."""
        return self.backend.side_channel_endpoint()

    def held_payloads(self) -> tuple[int, int]:
        """``(payloads, bytes)`` published here and not yet consumed."""
        return self.backend.held_payloads()

    def lease_until(self, key: str) -> float | None:
        """Producer: None once the payload under ``key`` is gone (consumed, withdrawn, or
        the backend cannot tell), else the monotonic time a consumer extended it to."""
        return self.backend.held_until(self.from_stage, self.to_stage, key)

    def withdraw(self, key: str, parts: int = 1) -> None:
        """Producer: remove the unconsumed payload under ``key`` (all ``parts``)."""
        for i in range(max(1, parts)):
            self.backend.cleanup(part_key(key, i))

    def extend(self, key: str, endpoint: dict[str, Any] | None, seconds: float) -> int:
        """Consumer: extend the producer's lease of every part of the payload under ``key``
        by ``seconds``; the number of parts extended (0: absent, or no leases here)."""
        done = 0
        for i in range(MAX_PARTS):
            if not self.backend.extend(
                self.from_stage, self.to_stage, part_key(key, i), seconds, endpoint
            ):
                break
            done += 1
        return done

    def hold(self, key: str) -> str:
        """Producer: the hold on the blocks of the shared-pages payload about to go under
        ``key`` (needs a cache region)."""
        return self._region().hold(self.from_stage, self.to_stage, key)

    def revoke(self, hold: str) -> None:
        """Producer: void ``hold`` (its blocks were freed); a reader copying under it fails."""
        self._region().revoke(hold)

    def expire_hold(self, hold: str) -> bool:
        """Producer: void ``hold`` and take it back even from a reader still holding it
        (past the lease and its grace)."""
        return self._region().expire_hold(hold)

    def hold_released(self, hold: str) -> bool:
        return self._region().released(hold)

    def take_back(self, hold: str) -> bool:
        return self._region().take_back(hold)

    def release_hold(self, key: str) -> None:
        """Consumer: release the hold of the payload under ``key`` unread (no-op without a
        cache region or a hold)."""
        region = self.backend.cache_region
        if region is not None:
            region.release(region.hold_name(self.from_stage, self.to_stage, key))

    def _region(self) -> CacheRegion:
        region = self.backend.cache_region
        if region is None:
            raise ConfigError(
                f"backend {type(self.backend).__name__} exports no KV cache region: holds "
                "need a backend with share_cache or register_cache"
            )
        return region

    def close(self) -> None:
        self.backend.close()
