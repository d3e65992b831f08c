"""Shared fixtures: tiny models, and a /dev/shm leak check around every test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _models import tiny_model

SHM_PREFIX = "omnikv"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default tiny model (2 layers, 2 KV heads, head size 64, fp32)."""
    return tiny_model()


def _our_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _left_by_us(name: str) -> bool:
    """Files of this process or of exited ones (a test's children); a live process of
    another run on this host owns its files."""
    from vllm_omni_kv.backends.shm import arena

    pid = arena._owner_pid(name)
    return pid is None or pid == os.getpid() or not arena.pid_alive(pid)


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Every test must leave /dev/shm as it found it (our segments are named omnikv*)."""
    before = _our_segments()
    yield
    leaked = {n for n in _our_segments() - before if _left_by_us(n)}
    for name in leaked:  # clean up so one leak does not cascade into other tests
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"
