"""The omni-connector interface every transport backend implements."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from vllm_omni_kv.backends.cache_region import CacheRegion
from vllm_omni_kv.closing import Closing
from vllm_omni_kv.wire.stream import PayloadStream

#: how long ``get`` waits for a frame it has opened to arrive in full (seconds)
GET_WAIT_S = 30.0


class OmniConnectorBase(Closing, ABC):
    """Key-addressed put / open-stream transport between pipeline stages.

    ``put`` stores an object under a key for an edge ``from_stage -> to_stage``;
    ``open_stream`` claims it (once, unless the backend documents otherwise) and
    returns a :class:`~vllm_omni_kv.wire.stream.PayloadStream` whose ``load``
    brings just the byte ranges a reader needs. ``get`` and ``discard`` are
    helpers on top. Objects cross processes in the packed frame format of
    :mod:`vllm_omni_kv.wire.codec` (never pickle).
    """

    #: the settings this backend reads from its config (``backend_extra``); any other key
    #: fails at start (:meth:`~vllm_omni_kv.backends.factory.OmniConnectorFactory.check_config`).
    #: None: not declared, every key accepted
    CONFIG_KEYS: ClassVar[frozenset[str] | None] = None
    #: True when ``open_stream`` can hand over a frame while it is still being written.
    supports_streaming: bool = False
    #: the producer's KV cache, exported for consumers to copy pages out of (None: the
    #: backend moves packed frames only); see :mod:`vllm_omni_kv.backends.cache_region`
    cache_region: CacheRegion | None = None
    #: whether a receiver checks every frame's chunk digests (a backend setting)
    verify: bool = True
    #: what carries the bytes (:meth:`transport`)
    TRANSPORT: ClassVar[str] = "unknown"

    _closed: bool = False

    @abstractmethod
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Store ``data``; return ``(success, serialized_size, metadata)``."""

    @abstractmethod
    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Claim the frame under ``get_key``; None when it is not there (yet).

        Returns once the frame's header is known; its bytes arrive through the
        stream's ``load``. Raises ``KVPayloadError`` for a corrupt frame and
        ``KVTransferError`` when its producer is gone: waiting cannot fix either.
        """

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """``(object, serialized_size)`` with every byte loaded and verified; None when absent.

        Waits at most :data:`GET_WAIT_S` for a frame still being written.
        """
        stream = self.open_stream(from_stage, to_stage, get_key, metadata)
        if stream is None:
            return None
        with stream:
            for _ in stream.load(None, time.monotonic() + GET_WAIT_S):
                pass
            return stream.obj, stream.size

    def discard(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Tell the producer its frame under ``key`` will not be read; True when one was there.

        Moves no payload bytes.
        """
        stream = self.open_stream(from_stage, to_stage, key, metadata)
        if stream is None:
            return False
        stream.close()
        return True

    def extend(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        seconds: float,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Consumer: ask the producer to keep the unconsumed payload under ``key`` at least
        ``seconds`` longer (from now; the producer may cap it). True when the payload was
        there and its lease was extended; the default (a backend without payload leases)
        extends nothing and returns False."""
        return False

    def held_until(self, from_stage: str, to_stage: str, key: str) -> float | None:
        """Producer: whether this process still holds the payload it put under ``key``.

        None when it does not (consumed, withdrawn) or the backend cannot tell (the
        default); else the ``time.monotonic()`` deadline a consumer extended its lease
        to (``0.0`` when never extended).
        """
        return None

    def side_channel_endpoint(self) -> tuple[str, int] | None:
        """Producer: the ``(host, port)`` its side channel listens on, which consumers
        address; None for a backend without one (shared memory, stores, receivers)."""
        return None

    def held_payloads(self) -> tuple[int, int]:
        """``(payloads, bytes)`` this process published and still holds unconsumed."""
        return 0, 0

    @abstractmethod
    def cleanup(self, request_id: str) -> None:
        """Drop any resources still held for ``request_id``."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Return status and counters (at least ``{"status": ...}``)."""

    def transport(self) -> str:
        """What carries this backend's bytes, for logs and metrics: a short name, constant
        for the backend's life (``shm``, ``cuda_ipc``, ``mooncake_te:tcp``, ``nixl:UCX``)."""
        return self.TRANSPORT

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:  # best effort: never leak segments/threads on GC
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
