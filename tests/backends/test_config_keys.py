"""Backend settings (``backend_extra`` / ``connector_config``): each backend accepts exactly
the keys its code reads, and a typo fails at start naming the nearest valid key, on the
vLLM connector path, in an omni transfer config and through the vLLM-free manager."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

from vllm_omni_kv.backends import factory
from vllm_omni_kv.backends.factory import INJECTED_KEYS, OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.testing.fake_backend import register_fake_backend
from vllm_omni_kv.transfer.kv_config import OmniKVCacheConfig
from vllm_omni_kv.transfer.manager import OmniKVTransferManager
from vllm_omni_kv.wire.auth import AuthKey

#: modules that read a backend's config through a helper function, not a method
_HELPERS = {
    "PullTransferConnector": (
        "vllm_omni_kv.backends.pull.side_channel",  # sender_zmq_port(config)
        "vllm_omni_kv.wire.auth",  # auth_of(config)
    )
}
_CONFIG_NAMES = {"cfg", "config"}


def _is_config(node: ast.expr) -> bool:
    """``cfg`` / ``config`` / ``self.config``: the names backends give their settings."""
    if isinstance(node, ast.Name):
        return node.id in _CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "config"


def _keys_read(module_name: str) -> set[str]:
    """String keys read from a config in ``module_name``: ``cfg.get("k")``, ``cfg["k"]``."""
    tree = ast.parse(Path(inspect.getfile(sys.modules[module_name])).read_text())
    keys: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _is_config(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            keys.add(node.args[0].value)
        if (
            isinstance(node, ast.Subscript)
            and _is_config(node.value)
            and isinstance(node.slice, ast.Constant)
        ):
            keys.add(node.slice.value)
    return keys


def _read_by(name: str) -> set[str]:
    """Every key the backend registered as ``name`` reads, over its classes and helpers."""
    module, cls = factory._BUILTIN[name]
    klass = getattr(importlib.import_module(module), cls)
    modules: set[str] = set()
    for c in klass.__mro__:
        if c.__module__.startswith("vllm_omni_kv.backends."):
            modules.add(c.__module__)
            modules.update(_HELPERS.get(c.__name__, ()))
    for m in modules:
        importlib.import_module(m)
    return set().union(*(_keys_read(m) for m in modules))


@pytest.mark.parametrize("name", sorted(factory._BUILTIN))
def test_backends_accept_exactly_the_keys_they_read(name: str) -> None:
    declared = OmniConnectorFactory.config_keys(name)
    assert declared is not None, f"{name} declares no CONFIG_KEYS"
    read = _read_by(name)
    assert len(read) >= 6, read  # the scan found the backend's settings
    assert read - INJECTED_KEYS <= declared, "read but rejected"
    assert declared - INJECTED_KEYS <= read, "accepted but never read"


#: backend -> (a typo, the key it should suggest), one per backend
TYPOS = {
    "shm": ("share_cahce", "share_cache"),
    "cuda_ipc": ("namespce", "namespace"),
    "mooncake": ("protocl", "protocol"),
    "mooncake_store": ("mastr", "master"),
    "nixl": ("nixl_backend", "nixl_backends"),
    "yuanrong": ("get_sub_timout_ms", "get_sub_timeout_ms"),
    "yuanrong_te": ("device_nmae", "device_name"),
}


def test_every_backend_has_a_typo_case() -> None:
    names = {OmniConnectorFactory.resolve_name(n) for n in TYPOS}
    assert names == set(factory._BUILTIN) - {"MooncakeConnector"}  # an alias class


@pytest.mark.parametrize("backend", sorted(TYPOS))
def test_a_typo_in_backend_extra_names_the_nearest_key(backend: str) -> None:
    typo, near = TYPOS[backend]
    with pytest.raises(ConfigError) as e:
        parse_omni_kv_config({"backend": backend, "backend_extra": {typo: 1}}, "kv_producer")
    msg = str(e.value)
    assert msg.startswith(
        f"kv_connector_extra_config.backend_extra: unknown key {typo!r} for backend "
        f"{backend}; did you mean {near!r}? Valid keys: "
    ), msg


def test_a_typo_in_the_backend_mapping_and_every_unknown_key_are_named() -> None:
    raw = {"backend": {"name": "shm", "extra": {"ttl_second": 5, "zzz": 1}}}
    with pytest.raises(ConfigError) as e:
        parse_omni_kv_config(raw)
    assert str(e.value).startswith(
        "kv_connector_extra_config.backend.extra: unknown key 'ttl_second' for backend shm; "
        "did you mean 'ttl_seconds'? unknown key 'zzz' for backend shm. Valid keys: "
    ), e.value


def test_a_typo_in_an_omni_transfer_config_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "omni.json"
    spec = {"name": "mooncake", "extra": {"protocol": "tcp", "buffer_ttl": 60}}
    path.write_text(json.dumps({"connectors": {"p->d": spec}}))
    raw = {"omni_transfer_config": str(path), "omni_from_stage": "p", "omni_to_stage": "d"}
    with pytest.raises(ConfigError, match=r"unknown key 'buffer_ttl' .*'buffer_ttl_s'\?") as e:
        parse_omni_kv_config(raw)
    assert str(e.value).startswith("kv_connector_extra_config.omni_transfer_config (edge 'p'")


def test_the_manager_rejects_a_typo_before_its_connector_starts() -> None:
    stage = {"connector_config": {"type": "SharedMemoryConnector", "namespace": "x", "strem": 0}}
    with pytest.raises(ConfigError) as e:
        OmniKVTransferManager.from_od_config({"omni_kv_config": stage})
    assert str(e.value).startswith(
        "connector_config: unknown key 'strem' for backend SharedMemoryConnector; "
        "did you mean 'stream'?"
    ), e.value
    with pytest.raises(ConfigError, match="unknown key 'stage_id' for backend shm"):
        OmniKVCacheConfig(connector_config={"name": "shm", "stage_id": 1})  # not a shm key


def test_the_factory_rejects_a_typo() -> None:
    spec = ConnectorSpec("shm", {"heartbeat_stale": 10})
    with pytest.raises(ConfigError, match="did you mean 'heartbeat_stale_s'"):
        OmniConnectorFactory.create_connector(spec)


def test_injected_and_declared_keys_start_a_real_backend() -> None:
    ns = f"keys{os.getpid()}"
    extra = {
        "namespace": ns,
        "shm_threshold_bytes": 1024,
        "pool_max_bytes": 1 << 20,
        "ttl_seconds": 60,
        "heartbeat_stale_s": 10,
        "verify": True,
        "stream": False,
        "populate": False,
        "share_cache": False,
        "verify_pages": False,
    }
    assert set(extra) == OmniConnectorFactory.config_keys("shm")
    # what vllm-omni's stage config and the vLLM connector add on top
    extra |= {"role": "receiver", "local_rank": 0, "auth_key": AuthKey(os.urandom(32))}
    OmniConnectorFactory.create_connector(ConnectorSpec("shm", extra)).close()
    cfg = OmniKVCacheConfig(connector_config={"type": "shm", "namespace": ns, "role": "sender"})
    assert cfg.connector_config is not None


def test_a_constructor_without_declared_keys_takes_any_key() -> None:
    register_fake_backend("fake-any-keys")
    assert OmniConnectorFactory.config_keys("fake-any-keys") is None
    OmniConnectorFactory.create_connector(ConnectorSpec("fake-any-keys", {"whatever": 1})).close()
