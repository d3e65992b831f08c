"""Loopback helpers for tests, demos and benchmarks."""

from __future__ import annotations

import socket
import time

from vllm_omni_kv.backends.net import free_port

__all__ = ["free_port", "free_port_block", "wait_for_port"]


def free_port_block(n: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port ``p`` such that ``p .. p+n-1`` were all free a moment ago."""
    for _ in range(attempts):
        base = free_port(host)
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found on {host}")


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")
