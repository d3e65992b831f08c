"""Omni-connector configuration: which backend serves which stage edge.

File/dict schema (YAML or JSON)::

    default_connector:            # used for every edge not listed below
      name: SharedMemoryConnector # or an alias: shm, mooncake, mooncake_store, yuanrong, nixl
      extra: {shm_threshold_bytes: 65536}
    connectors:                   # optional per-edge overrides
      - from_stage: "0"
        to_stage: "1"
        name: MooncakeTransferEngineConnector
        extra: {protocol: tcp, memory_pool_size: 268435456}

``connectors`` may also be a mapping ``{"0->1": {name: ..., extra: ...}}``.
Each spec's ``extra`` is checked against the keys its backend reads when the backend is
resolved (:meth:`~vllm_omni_kv.backends.factory.OmniConnectorFactory.check_config`).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni_kv.errors import ConfigError


def check_keys(
    given: Iterable[Any],
    valid: frozenset[str],
    where: str,
    what: str = "",
    shown: Iterable[str] = (),
) -> None:
    """Raise :class:`ConfigError` for keys of ``given`` outside ``valid``, naming the
    nearest valid key of each (``difflib``) and listing ``shown`` (default ``valid``)."""
    unknown = sorted((k for k in given if k not in valid), key=str)
    if not unknown:
        return
    choices = sorted(shown or valid)
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(str(key), choices, n=1)
        hints.append(
            f"unknown key {key!r}{what}" + (f"; did you mean {near[0]!r}?" if near else ".")
        )
    raise ConfigError(f"{where}: {' '.join(hints)} Valid keys: {', '.join(choices)}")


@dataclass
class ConnectorSpec:
    """Specification for a connector instance: registered name plus backend settings."""

    name: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"connector 'name' must be a non-empty string, got {self.name!r}")
        if not isinstance(self.extra, dict):
            raise ConfigError(
                f"connector 'extra' must be a mapping, got {type(self.extra).__name__}"
            )


@dataclass
class OmniTransferConfig:
    """Top-level omni-connector configuration: per-edge connectors plus a default."""

    connectors: dict[tuple[str, str], ConnectorSpec] = field(default_factory=dict)
    default_connector: ConnectorSpec | None = None

    def get_connector_for_edge(self, from_stage: str, to_stage: str) -> ConnectorSpec | None:
        """The spec for ``from_stage -> to_stage``, else the default (may be None)."""
        return self.connectors.get((str(from_stage), str(to_stage)), self.default_connector)


def _spec_from(obj: Any, where: str) -> ConnectorSpec:
    if isinstance(obj, str):
        return ConnectorSpec(name=obj)
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a mapping with 'name', got {type(obj).__name__}")
    name = obj.get("name", obj.get("type"))
    if name is None:
        raise ConfigError(f"{where}.name is missing (the backend, e.g. 'SharedMemoryConnector')")
    extra = obj.get("extra")
    if extra is None:  # flat form: every other key is a backend setting
        extra = {
            k: v for k, v in obj.items() if k not in ("name", "type", "from_stage", "to_stage")
        }
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}.extra must be a mapping, got {type(extra).__name__}")
    try:
        return ConnectorSpec(name=str(name), extra=dict(extra))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _parse(data: dict[str, Any], default_shm_threshold: int) -> OmniTransferConfig:
    known = {"default_connector", "connectors"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown omni transfer config field(s) {unknown}; expected {sorted(known)}"
        )
    cfg = OmniTransferConfig()
    if data.get("default_connector") is not None:
        cfg.default_connector = _spec_from(data["default_connector"], "default_connector")
    edges = data.get("connectors") or {}
    items: list[tuple[str, Any]]
    if isinstance(edges, dict):
        items = list(edges.items())
    elif isinstance(edges, list):
        items = [(f"connectors[{i}]", e) for i, e in enumerate(edges)]
    else:
        raise ConfigError(f"connectors must be a list or mapping, got {type(edges).__name__}")
    for label, entry in items:
        where = f"connectors[{label!r}]" if isinstance(edges, dict) else label
        if isinstance(edges, dict):
            if "->" not in label:
                raise ConfigError(f"{where}: edge keys are written 'FROM->TO', got {label!r}")
            src, dst = (s.strip() for s in label.split("->", 1))
        else:
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
            if "from_stage" not in entry or "to_stage" not in entry:
                raise ConfigError(f"{where}: 'from_stage' and 'to_stage' are required")
            src, dst = str(entry["from_stage"]), str(entry["to_stage"])
        cfg.connectors[(src, dst)] = _spec_from(entry, where)
    if cfg.default_connector is None and not cfg.connectors:
        cfg.default_connector = ConnectorSpec(
            "SharedMemoryConnector", {"shm_threshold_bytes": int(default_shm_threshold)}
        )
    for spec in [cfg.default_connector, *cfg.connectors.values()]:
        if spec is not None and spec.name in ("SharedMemoryConnector", "shm"):
            spec.extra.setdefault("shm_threshold_bytes", int(default_shm_threshold))
    return cfg


def load_omni_transfer_config(
    config_path: str | Path | None = None,
    config_dict: dict[str, Any] | None = None,
    default_shm_threshold: int = 65536,
) -> OmniTransferConfig | None:
    """Load an :class:`OmniTransferConfig` from a YAML/JSON file or a dict.

    Returns None when neither is given. Errors name the offending field.
    """
    if config_path is None and config_dict is None:
        return None
    if config_dict is None:
        path = Path(config_path)  # type: ignore[arg-type]
        if not path.is_file():
            raise ConfigError(f"omni transfer config file not found: {path}")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                loaded = json.loads(text)
            else:
                import yaml

                loaded = yaml.safe_load(text)
        except Exception as e:
            raise ConfigError(f"cannot parse omni transfer config {path}: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"omni transfer config {path} must hold a mapping at top level")
        config_dict = loaded
    if not isinstance(config_dict, dict):
        raise ConfigError(
            f"omni transfer config must be a mapping, got {type(config_dict).__name__}"
        )
    return _parse(config_dict, default_shm_threshold)
