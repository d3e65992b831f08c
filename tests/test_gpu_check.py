"""The offline GPU check (`make gpu-wheels && make gpu-check`, docs/gpu.md), on a CPU machine:
its wheel set resolves for CPython 3.12 from binary wheels alone, a built set installs
offline, a wrong set is refused, and the check and the probe stop loudly without CUDA."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".gpu-wheels"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def _run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_PY": sys.executable}
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_gpu_wheel_set_resolves_for_python_312_on_the_package_index() -> None:
    """pip resolves the pinned set for CPython 3.12 x86_64 from binary wheels (metadata
    only: no wheel is downloaded)."""
    r = _run(sys.executable, "scripts/gpu_wheels.py", "resolve")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "for CPython 3.12" in r.stdout


@pytest.mark.skipif(not WHEELS.is_dir(), reason="no .gpu-wheels in this checkout")
def test_built_gpu_wheels_resolve_offline_and_fit_the_carry_limit() -> None:
    r = _run(sys.executable, "scripts/gpu_wheels.py", "check")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not WHEELS.is_dir(), reason="no .gpu-wheels in this checkout")
def test_a_wheel_set_missing_a_dependency_is_refused(tmp_path: Path) -> None:
    for w in WHEELS.glob("*.whl"):
        if not w.name.lower().startswith("pygments-"):  # pytest needs it
            shutil.copy(w, tmp_path)
    r = _run(sys.executable, "scripts/gpu_wheels.py", "check", "--dest", str(tmp_path))
    assert r.returncode == 1
    assert "does not resolve offline" in r.stderr and "pygments" in r.stderr.lower()


def _pinned() -> dict[str, str]:
    """The wheel set's pins: normalized project name -> version."""
    pins = {}
    for line in (ROOT / "scripts" / "gpu_requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_every_plugin_the_conftests_need_is_in_the_gpu_wheel_set(
    request: pytest.FixtureRequest,
) -> None:
    """Each ``pytest_*`` hook a conftest under tests/ defines is specified by pytest or a
    plugin (pytest refuses an unknown hook at collection); the project providing the spec
    is pinned in the wheel set, at the version this environment runs."""
    owners = metadata.packages_distributions()
    needed: dict[str, str] = {}
    for conftest in sorted((ROOT / "tests").rglob("conftest.py")):
        for node in ast.parse(conftest.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("pytest_"):
                caller = getattr(request.config.pluginmanager.hook, node.name, None)
                spec = None if caller is None else caller.spec
                assert spec is not None, f"{conftest}: {node.name} is no hook of a loaded plugin"
                top = spec.namespace.__name__.split(".")[0]
                for dist in owners[top]:
                    needed[re.sub(r"[-_.]+", "-", dist).lower()] = node.name
    assert needed.get("pytest-xdist") == "pytest_xdist_make_scheduler"  # the reason for this test
    pins = _pinned()
    for dist, hook in needed.items():
        assert dist in pins, f"{hook} needs {dist}, which scripts/gpu_requirements.txt lacks"
        assert pins[dist] == metadata.version(dist), f"{dist}: pinned {pins[dist]}"


def test_wheels_for_another_python_or_two_versions_are_refused(tmp_path: Path) -> None:
    for name in (
        "numpy-2.3.5-cp311-cp311-manylinux_2_28_x86_64.whl",
        "msgpack-1.2.3-cp312-cp312-manylinux_2_17_x86_64.whl",
        "msgpack-1.2.4-cp312-cp312-manylinux_2_17_x86_64.whl",
        "xxhash-4.1.0-cp312-cp312-macosx_11_0_arm64.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    r = _run(sys.executable, "scripts/gpu_wheels.py", "check", "--dest", str(tmp_path))
    assert r.returncode == 1
    assert "numpy-2.3.5-cp311-cp311-manylinux_2_28_x86_64.whl: does not install" in r.stderr
    assert "xxhash-4.1.0-cp312-cp312-macosx_11_0_arm64.whl: does not install" in r.stderr
    assert "msgpack: two versions (1.2.3, 1.2.4)" in r.stderr


@no_cuda
def test_gpu_check_stops_at_once_without_cuda(tmp_path: Path) -> None:
    r = _run("bash", "scripts/gpu_check.sh", "run", str(tmp_path / "out"))
    assert r.returncode == 2
    assert "needs a CUDA device" in r.stdout + r.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()


@no_cuda
def test_gpu_probe_fails_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    r = _run(sys.executable, "scripts/gpu_probe.py", "--out", str(out))
    assert r.returncode == 2 and "no CUDA device" in r.stderr
    assert not out.exists()
