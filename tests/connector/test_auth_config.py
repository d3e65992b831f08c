"""``auth_key_file`` in kv_connector_extra_config: read at parse, the environment variable
as fallback, bad files named, the key handed to the backend, the unauthenticated warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vllm_omni_kv.connector import config as config_mod
from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.errors import ConfigError
from vllm_omni_kv.wire.auth import ENV_KEY_FILE, AuthKey


def _key(tmp_path: Path, secret: bytes = b"s" * 40, mode: int = 0o600) -> Path:
    f = tmp_path / "omnikv.key"
    f.write_bytes(secret)
    f.chmod(mode)
    return f


def test_auth_key_file_is_read_and_given_to_the_backend(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    cfg = parse_omni_kv_config({"backend": "mooncake", "auth_key_file": str(_key(tmp_path))})
    assert cfg.auth is not None and cfg.auth.same_key(AuthKey(b"s" * 40))
    assert cfg.backend.extra["auth_key"] is cfg.auth
    assert "ssss" not in repr(cfg) and "ssss" not in repr(cfg.backend)


def test_environment_variable_is_the_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    assert parse_omni_kv_config({}).auth is None
    monkeypatch.setenv(ENV_KEY_FILE, str(_key(tmp_path)))
    auth = parse_omni_kv_config({}).auth
    assert auth is not None and auth.same_key(AuthKey(b"s" * 40))


@pytest.mark.parametrize(
    "secret,mode,match",
    [(b"short", 0o600, "at least 32 bytes"), (b"s" * 40, 0o604, "chmod 600")],
)
def test_bad_key_files_fail_naming_the_field(tmp_path, secret, mode, match):
    with pytest.raises(ConfigError, match=f"auth_key_file.*{match}"):
        parse_omni_kv_config({"auth_key_file": str(_key(tmp_path, secret, mode))})
    with pytest.raises(ConfigError, match="auth_key_file"):
        parse_omni_kv_config({"auth_key_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="auth_key_file"):
        parse_omni_kv_config({"auth_key_file": 42})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(
    "backend,keyed,warned",
    [
        ("mooncake", False, True),
        ("mooncake_store", False, True),
        ("yuanrong", False, True),
        ("nixl", False, True),
        ("shm", False, False),
        ("mooncake", True, False),
    ],
)
def test_network_backends_without_a_key_warn_at_start(
    tmp_path, monkeypatch, backend, keyed, warned
):
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    raw = {"backend": backend}
    if keyed:
        raw["auth_key_file"] = str(_key(tmp_path))
    cfg = parse_omni_kv_config(raw)
    h = _Records()
    config_mod.logger.addHandler(h)
    try:
        cfg.log_trust()
    finally:
        config_mod.logger.removeHandler(h)
    hit = [m for m in h.lines if "not authenticated" in m and ENV_KEY_FILE in m]
    assert bool(hit) == warned, h.lines
