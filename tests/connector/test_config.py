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
        ({"recv_timout": 3}, "unknown key 'recv_timout'; did you mean 'recv_timeout'? Valid"),
        ({"ttl": 3}, "unknown key 'ttl'. Valid keys: auth_key_file, backend, backend_extra,"),
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
        ({"transfer_format": "raw_blocks"}, "transfer_format must be one of"),  # no alias
        ({"backend": {"name": "shm", "extra": [1]}}, "backend.extra must be a mapping"),
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


# -- configuration as users write it: role follows kv_role, default side-channel ports --------

#: what issue 13 asks for: the vLLM kv_role -> the Mooncake backend role
ROLE_OF = {"kv_producer": "sender", "kv_consumer": "receiver", "kv_both": "dual"}


@pytest.mark.parametrize("backend", ["mooncake", "MooncakeTransferEngineConnector", "yuanrong_te"])
@pytest.mark.parametrize("kv_role", sorted(ROLE_OF))
def test_transfer_engine_role_follows_kv_role(backend: str, kv_role: str) -> None:
    cfg = parse_omni_kv_config({"backend": backend, "backend_extra": {"protocol": "tcp"}}, kv_role)
    assert cfg.backend.extra == {"protocol": "tcp", "role": ROLE_OF[kv_role]}


def test_role_default_also_applies_to_an_omni_transfer_config() -> None:
    raw = {"omni_transfer_config": {"default_connector": {"name": "mooncake", "extra": {}}}}
    assert parse_omni_kv_config(raw, "kv_consumer").backend.extra["role"] == "receiver"


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [("kv_producer", "sender"), ("kv_producer", "dual"), ("kv_consumer", "receiver")]
    + [("kv_consumer", "dual"), ("kv_both", "dual")],
)
def test_an_explicit_role_that_fits_is_kept(kv_role: str, role: str) -> None:
    cfg = parse_omni_kv_config({"backend": "mooncake", "backend_extra": {"role": role}}, kv_role)
    assert cfg.backend.extra["role"] == role


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [("kv_producer", "receiver"), ("kv_consumer", "sender"), ("kv_both", "sender")],
)
def test_an_explicit_role_that_cannot_serve_kv_role_fails(kv_role: str, role: str) -> None:
    raw = {"backend": "mooncake", "backend_extra": {"role": role}}
    with pytest.raises(ConfigError, match=f"role {role!r} cannot serve kv_role {kv_role!r}") as e:
        parse_omni_kv_config(raw, kv_role)
    assert "kv_connector_extra_config.backend_extra.role" in str(e.value)


def test_backends_without_roles_and_unknown_kv_roles_are_untouched() -> None:
    assert parse_omni_kv_config({"backend": "shm"}, "kv_producer").backend.extra == {}
    assert "role" not in parse_omni_kv_config({"backend": "mooncake"}).backend.extra


def test_side_channel_port_is_free_by_default_and_explicit_ports_are_kept() -> None:
    from vllm_omni_kv.backends.pull.side_channel import sender_zmq_port

    assert sender_zmq_port({}) == 0  # bind a free port: no two servers collide
    assert sender_zmq_port({"local_rank": 1}) == 0
    assert sender_zmq_port({"zmq_port": 50051}) == 50051
    assert sender_zmq_port({"zmq_port": 40000, "local_rank": 2}) == 40000 + 2 * 16
    # vllm-omni's stage scheme, where receivers derive the port: base 50051 + 100 + stage
    assert sender_zmq_port({"from_stage": 1, "replica_id": 0}) == 50051 + 100 + 1


def _handshake(host: str, port: int) -> object:
    from vllm_omni_kv.connector.handshake import OmniKVHandshake

    return OmniKVHandshake(host=host, port=port)


def test_producer_advertises_the_port_its_workers_bound() -> None:
    from vllm_omni_kv.connector.handshake import advertise

    cfg = parse_omni_kv_config({"backend": "mooncake", "backend_extra": {"host": "auto"}})
    assert (cfg.remote_host, cfg.remote_port) == ("auto", 0)
    got = advertise(cfg, {0: _handshake("10.1.2.3", 43210)})
    assert (got.remote_host, got.remote_port) == ("10.1.2.3", 43210)
    # TP ranks on the rank rule (rank 0's port + 16 r) are fine
    two = advertise(cfg, {0: _handshake("h", 40000), 1: _handshake("h", 40016)})
    assert two.remote_port == 40000
    # shared memory (no handshake from the workers): nothing changes
    shm = parse_omni_kv_config(None)
    assert advertise(shm, {0: None}) == shm


def test_configured_endpoints_are_kept() -> None:
    from vllm_omni_kv.connector.handshake import advertise

    cfg = parse_omni_kv_config(
        {"backend": "mooncake", "backend_extra": {"host": "10.0.0.9", "zmq_port": 5600}}
    )
    got = advertise(cfg, {0: _handshake("10.0.0.9", 5600)})
    assert (got.remote_host, got.remote_port) == ("10.0.0.9", 5600)
    explicit = parse_omni_kv_config({"backend": "mooncake", "remote_port": 7000})
    assert advertise(explicit, {0: _handshake("127.0.0.1", 45000)}).remote_port == 7000


def test_tp_ranks_on_free_ports_need_a_configured_zmq_port() -> None:
    from vllm_omni_kv.connector.handshake import advertise

    cfg = parse_omni_kv_config({"backend": "mooncake"})
    with pytest.raises(ConfigError, match="set backend_extra.zmq_port"):
        advertise(cfg, {0: _handshake("h", 40000), 1: _handshake("h", 51234)})


def test_two_default_senders_on_one_host_bind_distinct_ports() -> None:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector
    from vllm_omni_kv.connector.handshake import worker_handshake

    # what a kv_producer's worker builds from a config without role or zmq_port
    extra = parse_omni_kv_config(
        {"backend": "mooncake", "backend_extra": {"protocol": "tcp", "host": "127.0.0.1"}},
        "kv_producer",
    ).backend.extra
    extra = {**extra, "memory_pool_size": 4 << 20, "local_rank": 0}
    a = MooncakeTransferEngineConnector(dict(extra))
    try:
        b = MooncakeTransferEngineConnector(dict(extra))
        try:
            ends = [
                worker_handshake(a.side_channel_endpoint()),
                worker_handshake(b.side_channel_endpoint()),
            ]
            assert all(e is not None and e.port > 0 for e in ends), ends
            assert ends[0] != ends[1]
        finally:
            b.close()
    finally:
        a.close()
