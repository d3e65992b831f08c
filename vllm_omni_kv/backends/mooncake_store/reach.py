"""Start-up check of ``MooncakeStoreConnector``: do the master (and an HTTP metadata server)
accept TCP connections? Fails in ``connect_timeout_s`` instead of the store client's ~90 s
of retries, naming the address."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from vllm_omni_kv.errors import ConfigError, KVTransferError


def check_reachable(master: str, metadata: str, timeout_s: float) -> None:
    """``KVTransferError`` naming the address when the master (or an HTTP metadata server)
    does not accept a connection within ``timeout_s``."""
    targets = [("master", master, _host_port(master))]
    if metadata.startswith("http"):
        targets.append(("metadata server", metadata, _host_port(metadata)))
    for what, address, hp in targets:
        if hp is None:
            if what == "master":
                raise ConfigError(
                    f"MooncakeStoreConnector: master must be 'host:port', got {address!r}"
                )
            continue
        why = _connect_error(hp[0], hp[1], timeout_s)
        if why is not None:
            raise KVTransferError(
                f"the Mooncake {what} at {address} does not accept connections ({why}) "
                f"after {timeout_s:g}s: start mooncake_master there "
                "(mooncake_master -enable_http_metadata_server=true) or point backend_extra "
                f"'{'master' if what == 'master' else 'metadata_server'}' at it; raise "
                "connect_timeout_s if it starts after the engines"
            )


def _connect_error(host: str, port: int, timeout_s: float) -> str | None:
    """None once ``host:port`` accepts a TCP connection (retried for ``timeout_s``), else why."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout_s))):
                return None
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.1)


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``http://host:port/...``; None for other forms."""
    netloc = urlsplit(address).netloc if "://" in address else address
    host, sep, port = netloc.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)
