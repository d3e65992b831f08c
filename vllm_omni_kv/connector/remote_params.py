"""The consumer's one strict reading of a request's ``kv_transfer_params``.

Those params come from the HTTP client (a proxy passes on what the producer
returned), so every field is untrusted: each is checked for type, finite range and
length before anything uses it, and anything off makes the request compute its prompt
locally with the reason logged; nothing here raises into vLLM's scheduler. The
transfer id is derived here from the validated engine and request ids, never taken
verbatim.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni_kv.connector.metadata import transfer_id
from vllm_omni_kv.errors import OmniKVError

#: the largest producer TP size a consumer accepts
MAX_TP_SIZE = 1024
#: the longest engine or request id accepted
MAX_ID_CHARS = 256
#: the longest host name accepted
MAX_HOST_CHARS = 253
#: the most KV cache groups, and block ids in all, a ``remote_block_ids`` may name
MAX_BLOCK_GROUPS = 64
MAX_BLOCK_IDS = 1 << 20
#: block ids are non-negative 32-bit integers
MAX_BLOCK_ID = (1 << 31) - 1
_HOST = re.compile(r"^[A-Za-z0-9.\-:\[\]_]+$")


class RemoteParamsError(OmniKVError, ValueError):
    """``kv_transfer_params`` that name no payload this consumer may load."""


@dataclass(frozen=True)
class RemoteParams:
    """Where a request's prefilled KV is, as validated from its ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    host: str | None
    port: int | None
    tp_size: int | None
    #: ``remote_block_ids`` per KV cache group (a 0.32-era flat list: one group); None if absent
    block_ids: tuple[tuple[int, ...], ...] | None = None

    @property
    def transfer_id(self) -> str:
        return transfer_id(self.engine_id, self.request_id)


def _id(params: Mapping[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise RemoteParamsError(f"{name} is missing or not a string")
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise RemoteParamsError(f"{name} is longer than {MAX_ID_CHARS} or not printable")
    return value


def _int(params: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RemoteParamsError(f"{name} is not a number")
    try:
        number = float(value) if not isinstance(value, int) else value
    except ValueError:
        raise RemoteParamsError(f"{name} is not a number") from None
    if isinstance(number, float) and (not math.isfinite(number) or not number.is_integer()):
        raise RemoteParamsError(f"{name} is not a finite integer")
    if not low <= int(number) <= high:
        raise RemoteParamsError(f"{name} {int(number)} is outside [{low}, {high}]")
    return int(number)


def _host(params: Mapping[str, Any]) -> str | None:
    host = params.get("remote_host")
    if host is None:
        return None
    if not isinstance(host, str) or len(host) > MAX_HOST_CHARS or not _HOST.match(host):
        raise RemoteParamsError("remote_host is not a host name or address")
    return host


def _block_list(value: Any, name: str) -> tuple[int, ...]:
    """One group's block ids: a list of at most ``MAX_BLOCK_IDS`` ints in range."""
    if not isinstance(value, list | tuple):
        raise RemoteParamsError(f"{name} is not a list")
    if len(value) > MAX_BLOCK_IDS:
        raise RemoteParamsError(f"{name} names more than {MAX_BLOCK_IDS} blocks")
    for b in value:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
            raise RemoteParamsError(
                f"{name} holds {b!r:.40}, not a block id in [0, {MAX_BLOCK_ID}]"
            )
    return tuple(value)


def _block_ids(params: Mapping[str, Any]) -> tuple[tuple[int, ...], ...] | None:
    """``remote_block_ids``: one list per KV cache group, as vLLM's connectors give it, or
    one flat list (a single group, as this package's producers gave it with vLLM 0.32)."""
    value = params.get("remote_block_ids")
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise RemoteParamsError("remote_block_ids is not a list")
    if not value or not isinstance(value[0], list | tuple):
        return (_block_list(value, "remote_block_ids"),)
    if len(value) > MAX_BLOCK_GROUPS:
        raise RemoteParamsError(f"remote_block_ids has more than {MAX_BLOCK_GROUPS} groups")
    if not all(isinstance(g, list | tuple) for g in value):
        raise RemoteParamsError("remote_block_ids mixes lists and block ids")
    if sum(len(g) for g in value) > MAX_BLOCK_IDS:
        raise RemoteParamsError(f"remote_block_ids names more than {MAX_BLOCK_IDS} blocks")
    return tuple(_block_list(g, f"remote_block_ids[{i}]") for i, g in enumerate(value))


def parse_remote_params(params: Mapping[str, Any], local_tp_size: int) -> RemoteParams:
    """The validated remote fields of ``params``; :class:`RemoteParamsError` says what is
    wrong. ``tp_size`` must divide or be a multiple of ``local_tp_size``."""
    tp = _int(params, "tp_size", 1, MAX_TP_SIZE)
    if tp is not None and tp % local_tp_size and local_tp_size % tp:
        raise RemoteParamsError(
            f"tp_size {tp} neither divides nor is a multiple of this engine's TP size "
            f"{local_tp_size}"
        )
    return RemoteParams(
        engine_id=_id(params, "remote_engine_id"),
        request_id=_id(params, "remote_request_id"),
        host=_host(params),
        port=_int(params, "remote_port", 0, 65535) or None,  # 0: no side channel (shm)
        tp_size=tp,
        block_ids=_block_ids(params),
    )
