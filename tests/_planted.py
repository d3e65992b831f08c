"""Shared-memory files as another process would leave them, for the liveness tests."""

from __future__ import annotations

import os
import time

import numpy as np
from _mp import CTX

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.liveness import W_BEAT, W_OWNER, W_PIDNS


def plant_segment(ns: str, pid: int, beat: int, ident: int, tag: str | None = None) -> str:
    """A segment file of namespace ``ns`` as a producer with ``pid`` would leave it: header
    words owner, heartbeat ``beat`` and owner identity ``ident``; returns its name."""
    tag = tag if tag is not None else f"planted{beat % 9973}"
    name = f"{arena.SEG_PREFIX}{pid}_{arena.namespace_tag(ns)}_{tag}"
    head = np.zeros(arena.SLOT_WORDS, dtype="<u8")
    head[[W_OWNER, W_BEAT, W_PIDNS]] = (12345, beat, ident)
    fd = os.open(arena.path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, head.tobytes() + bytes(4096))
    finally:
        os.close(fd)
    return name


def dead_pid() -> int:
    """The pid of a process that has exited."""
    p = CTX.Process(target=time.sleep, args=(0,))
    p.start()
    p.join(30)
    return p.pid
