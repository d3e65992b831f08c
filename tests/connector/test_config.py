"""``kv_connector_extra_config`` validation (no engine): every error names its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.errors import ConfigError


def test_defaults_are_shared_memory() -> None:
    cfg = parse_omni_kv_config(None)
    assert cfg.backend_name == "SharedMemoryConnector"
    assert (cfg.from_stage, cfg.to_stage) == ("prefill", "decode")
    assert cfg.recv_timeout == 30.0 and cfg.transfer_format == "auto"
    assert cfg.transfer_cpus == "auto"


def test_backend_mapping_and_settings() -> None:
    cfg = parse_omni_kv_config(
        {
            "backend": {"name": "mooncake", "extra": {"protocol": "tcp", "zmq_port": 5555}},
            "backend_extra": {"host": "10.0.0.2"},
            "recv_timeout": "2.5",
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "source_tp_size": 2,
        }
    )
    assert cfg.backend_name == "MooncakeTransferEngineConnector"
    assert cfg.backend.extra == {"protocol": "tcp", "zmq_port": 5555, "host": "10.0.0.2"}
    assert (cfg.remote_host, cfg.remote_port) == ("10.0.0.2", 5555)
    assert cfg.recv_timeout == 2.5 and (cfg.from_stage, cfg.to_stage) == ("0", "1")
    assert cfg.source_tp_size == 2 and cfg.target_tp_size is None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"recv_timout": 3}, "unknown field(s) ['recv_timout']"),
        ({"recv_timeout": 0}, "recv_timeout must be a number of seconds > 0"),
        ({"recv_timeout": "soon"}, "recv_timeout must be a number of seconds > 0"),
        ({"recv_timeout": True}, "recv_timeout"),
        ({"backend": "carrier-pigeon"}, "backend 'carrier-pigeon' is not a known backend"),
        ({"backend": {"extra": {}}}, "backend.name is missing"),
        ({"backend_extra": [1]}, "backend_extra must be a mapping"),
        ({"source_tp_size": 0}, "source_tp_size must be an integer >= 1"),
        ({"target_tp_size": "two"}, "target_tp_size must be an integer >= 1"),
        ({"load_threads": -1}, "load_threads must be an integer >= 1"),
        ({"omni_from_stage": ""}, "omni_from_stage must be a non-empty stage name"),
        ({"poll_interval": 0.5, "max_poll_interval": 0.1}, "max_poll_interval (0.1) must be >="),
        ({"remote_port": 70000}, "remote_port must be in [0, 65535]"),
        ({"transfer_format": "zip"}, "transfer_format must be one of"),
        ({"transfer_cpus": "3-1"}, "transfer_cpus must be 'auto', 'inherit' or a CPU list"),
        ({"transfer_cpus": [0, 1]}, "transfer_cpus must be 'auto', 'inherit' or a CPU list"),
        ({"omni_transfer_config": 5}, "omni_transfer_config: expected a file path or a mapping"),
    ],
)
def test_bad_values_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_omni_kv_config(raw)
    assert "kv_connector_extra_config" in str(e.value)
    assert field in str(e.value)


def test_omni_transfer_config_file_picks_the_edge(tmp_path: Path) -> None:
    path = tmp_path / "omni.json"
    path.write_text(
        json.dumps(
            {
                "default_connector": {"name": "shm"},
                "connectors": {"p->d": {"name": "mooncake", "extra": {"zmq_port": 6000}}},
            }
        )
    )
    cfg = parse_omni_kv_config(
        {"omni_transfer_config": str(path), "omni_from_stage": "p", "omni_to_stage": "d"}
    )
    assert cfg.backend_name == "MooncakeTransferEngineConnector" and cfg.remote_port == 6000
    other = parse_omni_kv_config({"omni_transfer_config": str(path)})
    assert other.backend_name == "SharedMemoryConnector"


def test_omni_transfer_config_without_the_edge_fails(tmp_path: Path) -> None:
    path = tmp_path / "omni.json"
    path.write_text(json.dumps({"connectors": {"a->b": {"name": "shm"}}}))
    with pytest.raises(ConfigError, match="no connector for the edge 'prefill' -> 'decode'"):
        parse_omni_kv_config({"omni_transfer_config": str(path)})
    with pytest.raises(
        ConfigError, match="omni_transfer_config: omni transfer config file not found"
    ):
        parse_omni_kv_config({"omni_transfer_config": str(tmp_path / "missing.yaml")})
