"""``OmniKVCacheConfig``: the manager's settings, and parsing of vllm-omni stage configs
and of vLLM's ``kv_transfer_config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.transfer.session import DEFAULT_MAX_PART_BYTES
from vllm_omni_kv.wire.auth import AuthKey

__all__ = [
    "DEFAULT_MAX_PART_BYTES",
    "OmniKVCacheConfig",
    "config_from_omni_kv",
    "config_from_stage",
    "config_from_vllm",
    "connector_spec",
    "field_of",
]


@dataclass
class OmniKVCacheConfig:
    """Configuration for :class:`OmniKVTransferManager`.

    ``local_rank`` (beyond the reference) pins this process's TP rank; by
    default it comes from vLLM's TP group (0 outside vLLM). ``send_retries``
    and ``retry_backoff`` bound the send retry loop. ``max_part_bytes`` splits
    larger payloads into layer-wise parts that a waiting receiver consumes
    while later parts are still being packed (0: one frame per payload; None,
    the default: one frame over a streaming backend such as shared memory,
    whose receivers already overlap with the sender byte by byte, else
    ``DEFAULT_MAX_PART_BYTES``).
    ``poll_interval`` is the first wait between receive polls and
    ``max_poll_interval`` the cap of their doubling backoff (seconds; the same
    meaning as in the vLLM connector's config). ``auth_key_file``: the shared secret
    (see :mod:`vllm_omni_kv.wire.auth`; default the file named by
    ``OMNIKV_AUTH_KEY_FILE``, else none): frames and side-channel messages carry MACs.
    ``connector_config``: the backend (``type``, or ``name``) and its settings; a key the
    backend does not read fails here, naming the nearest valid one.
    """

    connector_config: dict[str, Any] | None = None
    from_stage: str | None = None
    to_stage: str | None = None
    stage_id: str | int | None = None
    engine_input_source: list[str | int] | None = None
    need_recv_cache: bool = False
    need_send_cache: bool = False
    recv_timeout: float = 30.0
    from_tp: int = 1
    to_tp: int = 1
    local_rank: int | None = None
    send_retries: int = 3
    retry_backoff: float = 0.05
    max_part_bytes: int | None = None
    poll_interval: float = 0.001
    max_poll_interval: float = 0.02
    auth_key_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.recv_timeout, (int, float)) or self.recv_timeout <= 0:
            raise ConfigError(f"recv_timeout must be a positive number, got {self.recv_timeout!r}")
        for name in ("from_tp", "to_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"rank_mapping.{name} must be an int >= 1, got {value!r}")
        if self.max_part_bytes is not None and (
            not isinstance(self.max_part_bytes, int)
            or isinstance(self.max_part_bytes, bool)
            or self.max_part_bytes < 0
        ):
            raise ConfigError(
                "max_part_bytes must be an int >= 0 (0 disables parts) or null (automatic), "
                f"got {self.max_part_bytes!r}"
            )
        for name in ("poll_interval", "max_poll_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{name} must be a number of seconds in (0, 1], got {value!r}")
        if self.poll_interval > self.max_poll_interval:
            raise ConfigError(
                f"poll_interval ({self.poll_interval}) must not exceed max_poll_interval "
                f"({self.max_poll_interval})"
            )
        if self.send_retries < 1:
            raise ConfigError(f"send_retries must be >= 1, got {self.send_retries}")
        if self.connector_config is not None and not isinstance(self.connector_config, dict):
            raise ConfigError("connector_config must be a mapping with a 'type' (backend name)")
        if self.connector_config:
            _check_connector_config(self.connector_config)


def _check_connector_config(cc: dict[str, Any]) -> None:
    """Unknown backend settings fail (an unknown backend fails when the connector starts)."""
    kind = "type" if cc.get("type") else "name"
    name = cc.get(kind)
    if isinstance(name, str) and name:
        extra = {k: v for k, v in cc.items() if k != kind}
        OmniConnectorFactory.check_config(ConnectorSpec(name, extra), "connector_config")


def field_of(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def config_from_omni_kv(kv: Any, stage_id: Any = None) -> OmniKVCacheConfig:
    rank_mapping = field_of(kv, "rank_mapping") or {}
    return OmniKVCacheConfig(
        connector_config=field_of(kv, "connector_config"),
        from_stage=_opt_str(field_of(kv, "omni_from_stage")),
        to_stage=_opt_str(field_of(kv, "omni_to_stage")),
        stage_id=field_of(kv, "stage_id", stage_id),
        engine_input_source=field_of(kv, "engine_input_source"),
        need_send_cache=bool(field_of(kv, "need_send_cache", False)),
        need_recv_cache=bool(field_of(kv, "need_recv_cache", False)),
        recv_timeout=float(field_of(kv, "recv_timeout", 30.0)),
        from_tp=int(field_of(rank_mapping, "from_tp", 1)),
        to_tp=int(field_of(rank_mapping, "to_tp", 1)),
        local_rank=field_of(kv, "local_rank"),
        max_part_bytes=_opt_int(field_of(kv, "max_part_bytes")),
        poll_interval=float(field_of(kv, "poll_interval", 0.001)),
        max_poll_interval=float(field_of(kv, "max_poll_interval", 0.02)),
        auth_key_file=field_of(kv, "auth_key_file"),
    )


def config_from_stage(config: Any) -> OmniKVCacheConfig:
    """The settings of a stage config carrying ``omni_kv_config`` (defaults without one)."""
    kv = field_of(config, "omni_kv_config")
    if kv is None:
        return OmniKVCacheConfig()
    return config_from_omni_kv(kv, stage_id=field_of(config, "stage_id"))


def config_from_vllm(vllm_config: Any, model_config: Any) -> OmniKVCacheConfig:
    """``model_config.omni_kv_config``, else ``kv_transfer_config``'s
    ``kv_connector_extra_config`` (``omni_connector_config`` plus the stage keys; the
    send/receive sides default from ``kv_role``); defaults without either."""
    if model_config is not None and field_of(model_config, "omni_kv_config") is not None:
        return config_from_stage(model_config)
    ktc = field_of(vllm_config, "kv_transfer_config")
    extra = dict(field_of(ktc, "kv_connector_extra_config") or {}) if ktc is not None else {}
    if "omni_connector_config" not in extra:
        return OmniKVCacheConfig()
    kv = {**extra, "connector_config": extra["omni_connector_config"]}
    role = field_of(ktc, "kv_role")
    kv.setdefault("need_send_cache", role in ("kv_producer", "kv_both"))
    kv.setdefault("need_recv_cache", role in ("kv_consumer", "kv_both"))
    return config_from_omni_kv(kv)


def connector_spec(config: OmniKVCacheConfig, auth: AuthKey | None = None) -> ConnectorSpec:
    """The backend to start from ``config.connector_config``; ``auth`` (the shared secret)
    becomes its ``auth_key`` unless the connector config sets one."""
    cc = config.connector_config
    if not cc:
        raise ConfigError(
            "no connector configured: set connector_config={'type': 'SharedMemoryConnector', ...}"
        )
    cc = dict(cc)
    if auth is not None:  # the backend's side channel uses the same key
        cc.setdefault("auth_key", auth)
    name = cc.pop("type", None) or cc.pop("name", None)
    if not name:
        raise ConfigError("connector_config.type is missing (e.g. 'SharedMemoryConnector')")
    return ConnectorSpec(str(name), cc)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _opt_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise ConfigError(f"max_part_bytes must be an int or null, got {v!r}")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"max_part_bytes must be an int or null, got {v!r}") from None
