"""Shared fixtures: tiny models, and a /dev/shm leak check around every test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# pytest-xdist: each worker keeps its shared-memory files (and those of the engines it
# starts) in its own directory on /dev/shm, so one worker's leak check never sees, or
# removes, another's files. Set before anything imports the shm backend.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMNIKV_SHM_DIR" not in os.environ:
    _WORKER_SHM = f"/dev/shm/omnikv-test-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}"
    os.makedirs(_WORKER_SHM, mode=0o700, exist_ok=True)
    os.environ["OMNIKV_SHM_DIR"] = _WORKER_SHM

import pytest  # noqa: E402
from _models import tiny_model  # noqa: E402

from vllm_omni_kv.backends.shm import arena  # noqa: E402

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
        return {n for n in os.listdir(arena.SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _left_by_us(name: str) -> bool:
    """Files of this process or of exited ones (a test's children); a live process of
    another run on this host owns its files."""
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
            os.unlink(os.path.join(arena.SHM_DIR, name))
        except OSError:
            pass
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker's shared-memory directory goes with it."""
    worker_dir = os.environ.get("OMNIKV_SHM_DIR", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and worker_dir.startswith("/dev/shm/omnikv-test-"):
        shutil.rmtree(worker_dir, ignore_errors=True)
