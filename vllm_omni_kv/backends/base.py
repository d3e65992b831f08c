"""The omni-connector interface every transport backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from vllm_omni_kv.closing import Closing
from vllm_omni_kv.transfer import codec
from vllm_omni_kv.transfer.stream import CompleteStream, PayloadStream


class OmniConnectorBase(Closing, ABC):
    """Key-addressed put/get transport between pipeline stages.

    ``put`` stores an object under a key for an edge ``from_stage -> to_stage``;
    ``get`` retrieves it (once, unless the backend documents otherwise).
    Objects cross processes in the packed frame format of
    :mod:`vllm_omni_kv.transfer.codec` (never pickle).
    """

    #: True when ``put`` accepts packed device tensors / raw buffers directly.
    supports_raw_data: bool = False
    #: True when ``open_stream`` can hand over a frame while it is still being written.
    supports_streaming: bool = False

    _closed: bool = False

    @abstractmethod
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Store ``data``; return ``(success, serialized_size, metadata)``."""

    @abstractmethod
    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """Retrieve ``(object, serialized_size)``, or None when not (yet) available."""

    def open_stream(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> PayloadStream | None:
        """Like ``get`` but may return before the payload is complete (see
        :mod:`vllm_omni_kv.transfer.stream`); None when it is not available yet."""
        got = self.get(from_stage, to_stage, get_key, metadata)
        return None if got is None else CompleteStream(*got)

    @abstractmethod
    def cleanup(self, request_id: str) -> None:
        """Drop any resources still held for ``request_id``."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Return status and counters (at least ``{"status": ...}``)."""

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def serialize_obj(obj: Any) -> bytes:
        """Serialize ``obj`` (tensors, bytes, msgpack-able values) to the packed frame format."""
        return bytes(codec.encode(obj).to_bytearray())

    @staticmethod
    def deserialize_obj(data: bytes | bytearray | memoryview) -> Any:
        """Inverse of :meth:`serialize_obj`; raises ``KVPayloadError`` on malformed input."""
        return codec.decode(data)

    def __del__(self) -> None:  # best effort: never leak segments/threads on GC
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
