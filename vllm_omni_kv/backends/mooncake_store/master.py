"""Start a real ``mooncake_master`` on loopback (selftest, tests, demos, benchmarks).

``with mooncake_master() as m:`` starts the master bound to 127.0.0.1 on free
ports, with its embedded HTTP metadata server, waits until both ports accept
connections and always stops the process on exit (also when the body or the
start-up fails). ``m.store_config()`` is a ready ``MooncakeStoreConnector``
config.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_kv.backends.net import free_port
from vllm_omni_kv.errors import BackendUnavailable


def find_master_binary() -> str:
    """Path of ``mooncake_master`` (PATH, the interpreter's bin dir, or the wheel)."""
    candidates = [
        shutil.which("mooncake_master"),
        str(Path(sys.executable).with_name("mooncake_master")),
    ]
    try:
        import mooncake

        candidates.append(str(Path(mooncake.__file__).with_name("mooncake_master")))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise BackendUnavailable(
        "mooncake_master not found; it ships with the Mooncake wheel: "
        "pip install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)"
    )


@dataclass
class MasterHandle:
    host: str
    rpc_port: int
    http_port: int
    metrics_port: int
    proc: subprocess.Popen[bytes]
    log_path: str

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def store_config(self, **overrides: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "host": self.host,
            "master": self.master_address,
            "metadata_server": self.metadata_url,
            "proto": "tcp",
            "segment": 64 << 20,
            "localbuf": 32 << 20,
        }
        cfg.update(overrides)
        return cfg

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""


def _port_open(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; always reaps the child."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextmanager
def mooncake_master(
    host: str = "127.0.0.1",
    ready_timeout: float = 30.0,
    kv_lease_ttl_ms: int | None = None,
    extra_args: list[str] | None = None,
) -> Iterator[MasterHandle]:
    """Run ``mooncake_master`` on ``host`` with free ports; stop it on exit, always."""
    binary = find_master_binary()
    rpc, http, metrics = free_port(host), free_port(host), free_port(host)
    fd, log_path = tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")
    cmd = [
        binary,
        f"-rpc_address={host}",
        f"-rpc_port={rpc}",
        "-enable_http_metadata_server=true",
        f"-http_metadata_server_host={host}",
        f"-http_metadata_server_port={http}",
        f"-metrics_host={host}",
        f"-metrics_port={metrics}",
        "-logtostderr",
        "-minloglevel=1",
        *([f"-default_kv_lease_ttl={kv_lease_ttl_ms}"] if kv_lease_ttl_ms else []),
        *(extra_args or []),
    ]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(fd)
    handle = MasterHandle(host, rpc, http, metrics, proc, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while not (_port_open(host, rpc) and _port_open(host, http)):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with code {proc.returncode} during start-up:\n"
                    f"{handle.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"mooncake_master did not listen on {host}:{rpc}/{http} within "
                    f"{ready_timeout:.0f}s:\n{handle.log_tail()}"
                )
            time.sleep(0.05)
        yield handle
    finally:
        stop_process(proc)
        try:
            os.unlink(log_path)
        except OSError:
            pass
