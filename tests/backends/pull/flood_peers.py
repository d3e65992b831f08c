"""A network attacker for the side-channel tests, run as its own process (stdlib only).

``python flood_peers.py ENDPOINT PEERS SECONDS PAYLOAD_FILE...`` opens ``PEERS`` TCP
connections to ``ENDPOINT`` and, for ``SECONDS``, sends the payloads (each file one
length-prefixed request, cycled) on all of them as fast as the sockets take them, never
reading a reply; a connection the server closes is opened again. It prints one JSON
line: ``{"sent": requests sent, "reconnects": connections opened again}``.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
from pathlib import Path


def _open(host: str, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=1.0)
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def main(argv: list[str]) -> None:
    endpoint, peers, seconds = argv[0], int(argv[1]), float(argv[2])
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    frames = [Path(p).read_bytes() for p in argv[3:]]
    blob = b"".join(struct.pack(">I", len(f)) + f for f in frames)
    per_request = len(blob) / len(frames)
    socks = [_open(host, int(port)) for _ in range(peers)]
    sent_bytes = reconnects = 0
    deadline = time.monotonic() + seconds
    offsets = [0] * peers
    retry_at = [0.0] * peers
    while (now := time.monotonic()) < deadline:
        for i, sock in enumerate(socks):
            if sock is None:
                if now >= retry_at[i]:
                    socks[i], offsets[i] = _open(host, int(port)), 0
                    reconnects += 1
                    retry_at[i] = now + 0.05
                continue
            try:
                n = sock.send(blob[offsets[i] :] or blob)
            except BlockingIOError:
                continue
            except OSError:  # closed by the server: come back soon
                sock.close()
                socks[i], retry_at[i] = None, now + 0.05
                continue
            offsets[i] = (offsets[i] + n) % len(blob)
            sent_bytes += n
    for sock in socks:
        if sock is not None:
            sock.close()
    sent = int(sent_bytes / per_request)
    print(json.dumps({"sent": sent, "reconnects": reconnects}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
