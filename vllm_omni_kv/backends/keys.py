"""Key naming shared by the backends that address objects as ``key@from->to``."""

from __future__ import annotations


def edge_key(key: str, from_stage: str, to_stage: str) -> str:
    """The backend key of ``key`` on the edge ``from_stage -> to_stage``."""
    return f"{key}@{from_stage}->{to_stage}"


def is_request_key(backend_key: str, request_id: str) -> bool:
    """True when ``backend_key`` is ``request_id`` itself or one of its edge keys."""
    return backend_key == request_id or backend_key.startswith(f"{request_id}@")


def key_of_request(key: str, request_id: str) -> bool:
    """True when a transfer key belongs to ``request_id``: it is the id, or starts with
    ``<id>_`` or ends with ``_<id>`` (rank-aware and part keys are built that way)."""
    return key == request_id or key.startswith(request_id + "_") or key.endswith("_" + request_id)
