"""``kv_connector_extra_config`` of :class:`OmniKVConnector`: parsed and validated once.

Every field is checked when the connector is constructed (engine start), so a
typo or a bad value fails there with a message naming the field, never at the
first request; an unknown key, here or in the backend's settings, names the
nearest valid one. Accepted fields::

    backend              "shm" (default), "mooncake", any registered backend name or
                         alias, or {"name": ..., "extra": {...}}
    backend_extra        settings passed to the backend (mapping); the keys each backend
                         reads are its class's CONFIG_KEYS, any other key fails
    omni_transfer_config path to a YAML/JSON omni transfer config, or the mapping
                         itself; its spec for the edge omni_from_stage -> omni_to_stage
                         replaces ``backend``/``backend_extra``
    omni_from_stage      producer stage name (default "prefill")
    omni_to_stage        consumer stage name (default "decode")
    recv_timeout         seconds a consumer waits for a payload before it gives
                         up and reports the blocks as failed (default 30)
    poll_interval        first backoff between two polls of the backend (default 0.001)
    max_poll_interval    backoff cap (default 0.02)
    source_tp_size       producer TP size (default: the value the producer advertises
                         in kv_transfer_params, else this engine's TP size)
    target_tp_size       consumer TP size (default: this engine's TP size)
    load_threads         background threads receiving payloads (default 2)
    send_ttl             seconds a producer keeps an unconsumed payload (default 300): the
                         payload's lease, see "Payload lifetime" below
    hold_grace           seconds past a one-copy payload's lease a consumer may still be
                         copying its pages (default 30); then the producer takes the blocks
                         back anyway, and that consumer's load fails and is recomputed
    remote_host          host advertised to consumers (default: backend "host" or 127.0.0.1)
    remote_port          port advertised to consumers (default: backend "zmq_port", else the
                         port the producer's side channel bound, learned at engine start)
    transfer_format      "auto" (default: each layer's blocks as the cache holds them when
                         producer and consumer TP sizes match, else token-major K/V),
                         "paged_blocks" or "token_major"
    max_part_bytes       payloads above this travel as layer-wise parts (0: never; default:
                         one frame over shared memory, 8 MiB parts over other backends)
    staging_bytes        device memory a producer with a CUDA cache may hold for staging a
                         request's pages before they go to host memory (default 256 MiB; 0:
                         read the cache layer by layer instead)
    trusted_producers    producer endpoints a consumer pulls from: a list of "host:port" or
                         "host" (any port), or "*" (any). Default: this host's loopback
                         addresses and remote_host. A request whose kv_transfer_params name
                         another endpoint is computed locally (logged)
    kv_cache_layout      a vLLM KVCacheLayout name (LBHNC, LBNHC, ..., or NHD / HND) the
                         connector asks vLLM for (get_required_kvcache_layout); default:
                         none, the attention backend's choice (LBNHC on CUDA, LBHNC on
                         CPU). Equal layouts on both sides copy blocks byte for byte
    transfer_cpus        CPUs of the backend's threads (side channel, transfer-engine
                         I/O): "auto" (default: the CPUs the worker process had before
                         vLLM pinned its main thread), "inherit" (stay on the main
                         thread's pinned core) or a CPU list like "0-3,8"
    auth_key_file        path of a shared secret (>= 32 bytes, a file only its owner can
                         access) every stage of the deployment uses: frames and side-channel
                         messages carry keyed BLAKE2b MACs, and payloads or requests without
                         a valid MAC are refused. Default: the file named by the environment
                         variable OMNIKV_AUTH_KEY_FILE, else none (peers not authenticated)

Payload lifetime: ``send_ttl`` is the one lease to set. A producer withdraws a payload no
consumer took ``send_ttl`` seconds after sending it; a consumer still waiting for it extends
that lease by ``send_ttl`` every ``min(5, send_ttl / 3)`` seconds. Two backends keep a TTL of
their own on the buffers behind a payload, a backstop for a producer that stops tending its
leases: shm ``ttl_seconds`` (default 600; the producer removes older unconsumed entries and
caps a consumer's extension at it) and the pull backends' (mooncake, nixl, yuanrong_te)
``buffer_ttl_s`` (default 300; a pool buffer nobody pulled is freed, each extension capped
at it). The shorter of ``send_ttl`` and the backend TTL wins: keep the backend TTL at or
above ``send_ttl``.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_kv.backends.factory import OmniConnectorFactory, with_role_for
from vllm_omni_kv.backends.spec import ConnectorSpec, check_keys, load_omni_transfer_config
from vllm_omni_kv.connector.affinity import parse_cpu_list
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.kvcache.cache_layout import layout_name
from vllm_omni_kv.logger import init_logger
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, AuthKey, key_from_config

logger = init_logger(__name__)

KNOWN_FIELDS: frozenset[str] = frozenset(
    {
        "backend",
        "backend_extra",
        "omni_transfer_config",
        "omni_from_stage",
        "omni_to_stage",
        "recv_timeout",
        "poll_interval",
        "max_poll_interval",
        "source_tp_size",
        "target_tp_size",
        "load_threads",
        "send_ttl",
        "hold_grace",
        "max_part_bytes",
        "staging_bytes",
        "remote_host",
        "remote_port",
        "transfer_format",
        "transfer_cpus",
        "kv_cache_layout",
        "trusted_producers",
        "auth_key_file",
    }
)
#: backends whose peers reach each other over the network (an auth key matters most)
NETWORK_BACKENDS = frozenset(
    {
        "MooncakeTransferEngineConnector",
        "MooncakeStoreConnector",
        "YuanrongConnector",
        "YuanrongTransferEngineConnector",
        "NixlPullConnector",
    }
)
TRANSFER_FORMATS = ("auto", "paged_blocks", "token_major")

_WHERE = "kv_connector_extra_config"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TrustedProducers:
    """Endpoints a consumer may pull KV from: loopback always, plus ``entries``
    (``(host, port)``; port None: any), or anything when ``any``."""

    entries: tuple[tuple[str, int | None], ...]
    any: bool = False

    def allows(self, host: str | None, port: int | None) -> bool:
        if self.any or not host or _is_loopback(host):
            return True
        return any(h == host and (p is None or p == port) for h, p in self.entries)

    @classmethod
    def parse(cls, raw: Any) -> TrustedProducers:
        if raw is None:
            return cls(())
        if raw == "*":
            return cls((), any=True)
        if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
            raise ConfigError(
                f"{_WHERE}.trusted_producers must be a list of 'host:port' / 'host' strings "
                f"or '*', got {raw!r}"
            )
        entries: list[tuple[str, int | None]] = []
        for item in raw:
            if item.startswith("["):  # [v6] or [v6]:port
                host, _, rest = item[1:].partition("]")
                port = rest.removeprefix(":") or None
            elif item.count(":") == 1:
                host, port = item.split(":")
            else:  # a host name, an IPv4 address or a bare IPv6 address
                host, port = item, None
            try:
                entries.append((host, None if port is None else int(port)))
            except ValueError:
                raise ConfigError(
                    f"{_WHERE}.trusted_producers: {item!r} is not 'host:port' or 'host'"
                ) from None
        return cls(tuple(entries))


@dataclass(frozen=True)
class OmniKVConfig:
    """The validated settings of one :class:`OmniKVConnector`."""

    backend: ConnectorSpec = field(default_factory=lambda: ConnectorSpec("shm"))
    from_stage: str = "prefill"
    to_stage: str = "decode"
    recv_timeout: float = 30.0
    poll_interval: float = 0.001
    max_poll_interval: float = 0.02
    source_tp_size: int | None = None
    target_tp_size: int | None = None
    load_threads: int = 2
    send_ttl: float = 300.0
    hold_grace: float = 30.0
    max_part_bytes: int | None = None
    staging_bytes: int = 256 << 20
    remote_host: str = "127.0.0.1"
    remote_port: int = 0
    transfer_format: str = "auto"
    transfer_cpus: str = "auto"
    kv_cache_layout: str | None = None
    trusted_producers: TrustedProducers = field(default_factory=lambda: TrustedProducers(()))
    #: the shared secret of ``auth_key_file`` (read once, at parse), or None
    auth: AuthKey | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp = self.trusted_producers
        if not tp.any and self.remote_host and not tp.allows(self.remote_host, None):
            trusted = TrustedProducers((*tp.entries, (self.remote_host, None)))
            object.__setattr__(self, "trusted_producers", trusted)

    @property
    def backend_name(self) -> str:
        return OmniConnectorFactory.resolve_name(self.backend.name)

    def log_trust(self) -> None:
        """At connector start: say when a network backend runs without an auth key."""
        if self.auth is None and self.backend_name in NETWORK_BACKENDS:
            logger.warning(
                "OmniKVConnector: backend %s runs without an auth key, so peers are not "
                "authenticated (anyone who reaches its ports can send or fetch KV); set "
                "kv_connector_extra_config.auth_key_file or %s on every stage",
                self.backend_name,
                ENV_KEY_FILE,
            )


def _positive_float(raw: Mapping[str, Any], name: str, default: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{_WHERE}.{name} must be a number of seconds > 0, got {value!r}")
    try:
        out = float(value)
    except ValueError:
        raise ConfigError(
            f"{_WHERE}.{name} must be a number of seconds > 0, got {value!r}"
        ) from None
    if not math.isfinite(out) or out <= 0:
        raise ConfigError(f"{_WHERE}.{name} must be a number of seconds > 0, got {value!r}")
    return out


def _positive_int(raw: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{_WHERE}.{name} must be an integer >= 1, got {value!r}")
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(f"{_WHERE}.{name} must be an integer >= 1, got {value!r}") from None
    if out < 1:
        raise ConfigError(f"{_WHERE}.{name} must be an integer >= 1, got {value!r}")
    return out


def _part_bytes(raw: Mapping[str, Any]) -> int | None:
    value = raw.get("max_part_bytes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{_WHERE}.max_part_bytes must be an int >= 0 (0: one frame per payload) or null "
            f"(automatic), got {value!r}"
        )
    return value


def _staging_bytes(raw: Mapping[str, Any]) -> int:
    value = raw.get("staging_bytes", 256 << 20)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{_WHERE}.staging_bytes must be an int >= 0 (0: no device staging), got {value!r}"
        )
    return value


def _stage(raw: Mapping[str, Any], name: str, default: str) -> str:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise ConfigError(f"{_WHERE}.{name} must be a non-empty stage name, got {value!r}")
    return str(value)


def _backend_spec(
    raw: Mapping[str, Any], from_stage: str, to_stage: str, kv_role: str | None = None
) -> ConnectorSpec:
    """The backend of the edge; a Mooncake/Yuanrong TE ``role`` left out follows ``kv_role``."""
    spec = _edge_backend(raw, from_stage, to_stage)
    try:
        return with_role_for(spec, kv_role)
    except ConfigError as e:
        raise ConfigError(f"{_WHERE}.backend_extra.role: {e}") from None


def _edge_backend(raw: Mapping[str, Any], from_stage: str, to_stage: str) -> ConnectorSpec:
    if raw.get("omni_transfer_config") is not None:
        return _transfer_config_backend(raw["omni_transfer_config"], from_stage, to_stage)
    backend = raw.get("backend", "shm")
    extra = raw.get("backend_extra")
    extra = {} if extra is None else extra
    inner: Any = {}
    if isinstance(backend, Mapping):
        if "name" not in backend:
            raise ConfigError(f"{_WHERE}.backend.name is missing (e.g. 'shm' or 'mooncake')")
        inner = backend.get("extra") or {}
        backend = backend["name"]
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"{_WHERE}.backend must be a backend name like 'shm', got {backend!r}")
    for name, given in (("backend.extra", inner), ("backend_extra", extra)):
        if not isinstance(given, Mapping):
            raise ConfigError(f"{_WHERE}.{name} must be a mapping, got {type(given).__name__}")
        OmniConnectorFactory.check_config(ConnectorSpec(backend, dict(given)), f"{_WHERE}.{name}")
    return ConnectorSpec(backend, {**inner, **extra})


def _transfer_config_backend(src: Any, from_stage: str, to_stage: str) -> ConnectorSpec:
    try:
        if isinstance(src, Mapping):
            cfg = load_omni_transfer_config(config_dict=dict(src))
        elif isinstance(src, str):
            cfg = load_omni_transfer_config(config_path=src)
        else:
            raise ConfigError(f"expected a file path or a mapping, got {type(src).__name__}")
    except ConfigError as e:
        raise ConfigError(f"{_WHERE}.omni_transfer_config: {e}") from None
    spec = cfg.get_connector_for_edge(from_stage, to_stage) if cfg else None
    if spec is None:
        raise ConfigError(
            f"{_WHERE}.omni_transfer_config has no connector for the edge "
            f"{from_stage!r} -> {to_stage!r} and no default_connector; add one of them"
        )
    where = f"{_WHERE}.omni_transfer_config (edge {from_stage!r} -> {to_stage!r})"
    OmniConnectorFactory.check_config(spec, where)
    return ConnectorSpec(spec.name, dict(spec.extra))


def _advertised(raw: Mapping[str, Any], spec: ConnectorSpec) -> tuple[str, int]:
    """``(remote_host, remote_port)`` a producer advertises (port 0: learned at start)."""
    host = raw.get("remote_host", spec.extra.get("host", "127.0.0.1"))
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{_WHERE}.remote_host must be a host name, got {host!r}")
    port_raw = raw.get("remote_port", spec.extra.get("zmq_port", 0))
    if isinstance(port_raw, bool) or not isinstance(port_raw, (int, str)):
        raise ConfigError(f"{_WHERE}.remote_port must be a port number, got {port_raw!r}")
    try:
        port = int(port_raw)
    except ValueError:
        raise ConfigError(f"{_WHERE}.remote_port must be a port number, got {port_raw!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{_WHERE}.remote_port must be in [0, 65535], got {port}")
    return host, port


def _transfer_cpus(raw: Mapping[str, Any]) -> str:
    cpus = raw.get("transfer_cpus", "auto")
    if cpus not in ("auto", "inherit"):
        try:
            if not isinstance(cpus, str):
                raise ValueError("not a string")
            parse_cpu_list(cpus)
        except ValueError as e:
            raise ConfigError(
                f"{_WHERE}.transfer_cpus must be 'auto', 'inherit' or a CPU list like '0-3,8', "
                f"got {cpus!r} ({e})"
            ) from None
    return str(cpus)


def _layout(raw: Mapping[str, Any]) -> str | None:
    layout = raw.get("kv_cache_layout")
    if layout is None:
        return None
    if not isinstance(layout, str):
        raise ConfigError(f"{_WHERE}.kv_cache_layout must be a layout name, got {layout!r}")
    try:
        return layout_name(layout)
    except ConfigError as e:
        raise ConfigError(f"{_WHERE}.kv_cache_layout: {e}") from None


def parse_omni_kv_config(raw: Mapping[str, Any] | None, kv_role: str | None = None) -> OmniKVConfig:
    """Validate ``kv_connector_extra_config``; raise :class:`ConfigError` naming the field.

    ``kv_role``: vLLM's ``kv_role`` (``kv_producer``...), the default backend role.
    """
    raw = dict(raw or {})
    check_keys(raw, KNOWN_FIELDS, _WHERE)
    from_stage = _stage(raw, "omni_from_stage", "prefill")
    to_stage = _stage(raw, "omni_to_stage", "decode")
    spec = _backend_spec(raw, from_stage, to_stage, kv_role)
    resolved = OmniConnectorFactory.resolve_name(spec.name)
    if resolved not in OmniConnectorFactory.list_registered_connectors():
        raise ConfigError(
            f"{_WHERE}.backend {spec.name!r} is not a known backend; choose one of "
            f"{OmniConnectorFactory.list_registered_connectors()} or an alias like 'shm'"
        )
    poll = _positive_float(raw, "poll_interval", 0.001)
    max_poll = _positive_float(raw, "max_poll_interval", 0.02)
    if max_poll < poll:
        raise ConfigError(
            f"{_WHERE}.max_poll_interval ({max_poll}) must be >= poll_interval ({poll})"
        )
    load_threads = _positive_int(raw, "load_threads", 2)
    assert load_threads is not None
    host, port = _advertised(raw, spec)
    cpus = _transfer_cpus(raw)
    fmt = raw.get("transfer_format", "auto")
    if fmt not in TRANSFER_FORMATS:
        raise ConfigError(
            f"{_WHERE}.transfer_format must be one of {TRANSFER_FORMATS}, got {fmt!r}"
        )
    layout = _layout(raw)
    try:
        auth = key_from_config(raw.get("auth_key_file"))
    except ConfigError as e:
        raise ConfigError(f"{_WHERE}.auth_key_file: {e}") from None
    if auth is not None:  # the backend authenticates its side channel with the same key
        spec = ConnectorSpec(spec.name, {**spec.extra, "auth_key": auth})
    return OmniKVConfig(
        auth=auth,
        backend=spec,
        kv_cache_layout=layout,
        trusted_producers=TrustedProducers.parse(raw.get("trusted_producers")),
        transfer_format=str(fmt),
        transfer_cpus=cpus,
        from_stage=from_stage,
        to_stage=to_stage,
        recv_timeout=_positive_float(raw, "recv_timeout", 30.0),
        poll_interval=poll,
        max_poll_interval=max_poll,
        source_tp_size=_positive_int(raw, "source_tp_size", None),
        target_tp_size=_positive_int(raw, "target_tp_size", None),
        load_threads=load_threads,
        send_ttl=_positive_float(raw, "send_ttl", 300.0),
        hold_grace=_positive_float(raw, "hold_grace", 30.0),
        max_part_bytes=_part_bytes(raw),
        staging_bytes=_staging_bytes(raw),
        remote_host=host,
        remote_port=port,
    )
