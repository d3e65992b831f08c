"""``free_port``: ports for servers the tests start, out of the kernel's ephemeral range."""

from __future__ import annotations

import socket

from vllm_omni_kv.testing.net import LOW_PORT, ephemeral_floor, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    floor = ephemeral_floor()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random: concurrent callers rarely collide
    for port in ports:
        assert LOW_PORT <= port < floor, (port, floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(50):  # hold ports, then ask for more: none of the held ones comes back
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()
