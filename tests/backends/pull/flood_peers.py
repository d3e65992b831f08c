"""A network attacker for the side-channel tests, run as its own process (zmq only).

``python flood_peers.py ENDPOINT PEERS SECONDS PAYLOAD_FILE...`` connects ``PEERS`` DEALER
sockets to ``ENDPOINT`` and, for ``SECONDS``, sends the payloads (each file one message,
cycled) as fast as ZeroMQ takes them, never reading a reply. It prints one JSON line:
``{"sent": messages handed to ZeroMQ}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import zmq


def main(argv: list[str]) -> None:
    endpoint, peers, seconds = argv[0], int(argv[1]), float(argv[2])
    payloads = [Path(p).read_bytes() for p in argv[3:]]
    ctx = zmq.Context()
    socks = []
    for _ in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(endpoint)
        socks.append(s)
    sent, k = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for s in socks:
            try:  # zero-copy: every message shares the payload's bytes
                s.send_multipart([b"", payloads[k % len(payloads)]], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            sent += 1
            k += 1
    for s in socks:
        s.close(0)
    ctx.term()
    print(json.dumps({"sent": sent}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
