"""Loopback helpers for tests, demos and benchmarks."""

from __future__ import annotations

import random
import socket
import time

from vllm_omni_kv.backends import net

__all__ = ["free_port", "free_port_block", "wait_for_port"]

#: the lowest port :func:`free_port` hands out
LOW_PORT = 20000
_RANDOM = random.SystemRandom()


def ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (source ports, binds to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server the caller starts next. It is picked at
    random below the kernel's ephemeral range: a port from ``bind(0)`` can be taken, before
    the server binds it, by any connection's source port (a test engine failed to bind its
    side channel so in CI); random, so that concurrent callers rarely pick the same one."""
    high = ephemeral_floor() - 1
    for _ in range(200 if high - LOW_PORT >= 1000 else 0):
        port = _RANDOM.randint(LOW_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return net.free_port(host)


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
