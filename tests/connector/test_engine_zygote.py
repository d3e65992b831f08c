"""In-process engines forked from the preloaded interpreter (``engine_zygote``) behave as
freshly started ones: same greedy tokens, their own environment, log and exit codes as
``subprocess.Popen`` reports them. Three engine starts, two of them forked."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import LOG_DIR, EngineProc, engine_cfg, kill_group, make_prompts, omni_ktc

from vllm_omni_kv.testing.engine_zygote import IMPORT_ENV_PREFIXES, forkable

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
#: an environment key importing torch would read (its prefix is in IMPORT_ENV_PREFIXES):
#: an engine whose value differs from the zygote's cannot fork from it
FRESH_ENV = {"TORCH_OMNIKV_ZYGOTE_TEST": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    """A shared-memory directory only the forked producer's environment names."""
    d = Path(f"/dev/shm/omnikv-zygote-test-{os.getpid()}")
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, shm_dir: Path) -> Iterator[tuple[EngineProc, EngineProc]]:
    """A forked shm producer (its own ``OMNIKV_SHM_DIR``) and a fresh colocated engine
    (an environment the zygote cannot serve), both asked for ``preloaded``."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    ktc = omni_ktc("kv_producer", backend="shm", backend_extra={"namespace": shm_dir.name})
    forked = EngineProc(
        engine_cfg(tiny_model_dir, ktc),
        env={"OMNIKV_SHM_DIR": str(shm_dir)},
        log=LOG_DIR / "zygote-forked.log",
        preloaded=True,
    )
    fresh = EngineProc(engine_cfg(tiny_model_dir), env=FRESH_ENV, preloaded=True)
    try:
        forked.wait_ready()
        fresh.wait_ready()
        yield forked, fresh
    finally:
        for e in (forked, fresh):
            e.stop()


def test_env_decides_fork_or_fresh(pair: tuple[EngineProc, EngineProc]) -> None:
    forked, fresh = pair
    assert all(k.startswith(IMPORT_ENV_PREFIXES) for k in FRESH_ENV)
    assert forked.forked, forked.fresh_because
    assert not fresh.forked
    # each in its own process group, as start_new_session gives a fresh process
    assert os.getpgid(forked.proc.pid) == forked.proc.pid
    assert os.getpgid(forked.proc.pid) != os.getpgid(0)


def test_forked_engine_decodes_as_a_fresh_one(
    tiny_model_dir: Path, pair: tuple[EngineProc, EngineProc]
) -> None:
    forked, fresh = pair
    prompts = make_prompts(tiny_model_dir, 3, seed=77)
    a = forked.generate(prompts, max_tokens=12)
    b = fresh.generate(prompts, max_tokens=12)
    assert "error" not in a and "error" not in b, (a, b)
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
    assert all(len(o["token_ids"]) == 12 for o in a["outputs"])


def test_forked_engine_has_its_env_and_log(
    tiny_model_dir: Path, shm_dir: Path, pair: tuple[EngineProc, EngineProc]
) -> None:
    forked, _ = pair
    prompts = make_prompts(tiny_model_dir, 1, seed=78)
    r = forked.generate(prompts, max_tokens=1, kv_transfer_params=[REMOTE_DECODE])
    assert "error" not in r, r
    # the connector, imported after the fork, put its payload where the child's env says
    assert os.listdir(shm_dir), "no shared-memory file in the forked engine's OMNIKV_SHM_DIR"
    # vLLM's own log lines (stdout and stderr) reach the parent and the log file
    log = "\n".join(forked.log_lines)
    assert "KVConnectorBase_V1" in log, forked.tail()
    assert forked.log_path is not None and "KVConnectorBase_V1" in forked.log_path.read_text()


def test_forked_engine_exit_codes(
    tiny_model_dir: Path, pair: tuple[EngineProc, EngineProc]
) -> None:
    forked, _ = pair
    other = EngineProc(engine_cfg(tiny_model_dir), preloaded=True)
    try:
        other.wait_ready()
        assert other.forked, other.fresh_because
        assert other.proc.poll() is None
        kill_group(forked.proc.pid)
        assert forked.proc.wait(timeout=30) == -signal.SIGKILL
        assert forked.proc.returncode == -signal.SIGKILL
        # the other child of the zygote serves on, then exits cleanly when asked
        assert "error" not in other.generate([[1, 2, 3, 4]], max_tokens=2)
    finally:
        other.stop()
    assert other.proc.returncode == 0


def test_forkable_compares_import_time_keys() -> None:
    before = {"OMP_NUM_THREADS": "1", "HOME": "/root"}
    after = {**before, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}
    assert forkable({"OMP_NUM_THREADS": "1", "HOME": "/x", "OMNIKV_A": "1"}, before, after)
    assert forkable({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}, before, after)
    assert not forkable({"OMP_NUM_THREADS": "2"}, before, after)
    assert not forkable({}, before, after)  # OMP_NUM_THREADS unset: torch reads its default
    assert not forkable({**before, "TORCHINDUCTOR_CACHE_DIR": "/other"}, before, after)
    assert not forkable({**before, "LD_PRELOAD": "libtcmalloc.so"}, before, after)


def test_a_module_main_forks_with_its_argv_env_and_output(tmp_path: Path) -> None:
    """``spawn_main`` runs a module as ``python -m`` would (how the serve tests start
    ``vllm serve``): its argv, its environment, its output appended to the file, its exit
    code; an environment the zygote cannot serve gets ``None`` (start it fresh)."""
    from vllm_omni_kv.testing import engine_zygote
    from vllm_omni_kv.testing.engine_proc import engine_env

    zygote_env = engine_env({"in_process": True})
    env = {**zygote_env, "OMNIKV_ZYGOTE_MAIN": "from-the-parent"}
    script = tmp_path / "main_probe.py"
    script.write_text(
        "import os, sys\n"
        "print('argv', sys.argv[1:], os.environ['OMNIKV_ZYGOTE_MAIN'], flush=True)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    out = tmp_path / "out.log"
    out.write_text("earlier\n")
    proc = engine_zygote.spawn_main(
        ["main_probe", "3", "x y"], env, str(tmp_path), out, zygote_env, LOG_DIR / "zygote-main.log"
    )
    assert proc is not None, engine_zygote.refusal
    assert proc.wait(timeout=60) == 3
    assert out.read_text() == "earlier\nargv ['3', 'x y'] from-the-parent\n"
    assert (
        engine_zygote.spawn_main(["main_probe"], {**env, **FRESH_ENV}, ".", out, zygote_env) is None
    )
