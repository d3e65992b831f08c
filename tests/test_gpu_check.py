"""The offline GPU check (`make gpu-wheels && make gpu-check`, docs/gpu.md), on a CPU machine:
its wheel set resolves for CPython 3.12 from binary wheels alone, a built set installs
offline, a wrong set is refused, NIXL's wheel is carried stripped of nixl_ep (the rewrite
checked on a synthetic wheel), every step runs within the check's deadline, and the check
and the probe stop loudly without CUDA."""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from types import ModuleType

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


def _wheel_strip() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "wheel_strip", ROOT / "scripts" / "wheel_strip.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_wheel(path: Path, files: dict[str, bytes]) -> None:
    """A wheel of ``files`` plus METADATA, WHEEL and a correct RECORD."""
    info = "fakenixl-1.0.dist-info"
    files = {
        **files,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: fakenixl\nVersion: 1.0\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")


def test_a_stripped_wheel_lacks_the_folder_has_a_valid_record_and_installs(
    tmp_path: Path,
) -> None:
    """``strip_wheel`` drops a folder (as nixl_ep_cu13 from nixl-cu13), rewrites RECORD with
    the right hashes and sizes, and pip installs the result offline; a changed file is
    caught by the RECORD check."""
    ws = _wheel_strip()
    whl = tmp_path / "fakenixl-1.0-py3-none-any.whl"
    _fake_wheel(
        whl,
        {
            "fakenixl/__init__.py": b"VALUE = 3\n",
            "fake_ep/__init__.py": b"import torch\n",
            "fake_ep/big.so": os.urandom(200_000),
            "fake_epsilon/keep.py": b"# a name sharing the prefix stays\n",
        },
    )
    assert ws.record_problems(whl) == []
    got = ws.strip_wheel(whl, ("fake_ep/",))
    assert got["removed_files"] == ["fake_ep/__init__.py", "fake_ep/big.so"]
    assert got["wheel_bytes_after"] < got["wheel_bytes_before"] - 190_000
    assert ws.members_under(whl, ("fake_ep/",)) == [] and ws.record_problems(whl) == []
    with zipfile.ZipFile(whl) as z:
        assert "fake_epsilon/keep.py" in z.namelist()
    target = tmp_path / "site"
    r = _run(
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
        "--target", str(target), str(whl),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "fakenixl" / "__init__.py").read_text() == "VALUE = 3\n"
    assert not (target / "fake_ep").exists()
    tampered = tmp_path / "tampered" / whl.name
    tampered.parent.mkdir()
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tampered, "w") as dst:
        for name in src.namelist():
            data = b"VALUE = 4\n" if name == "fakenixl/__init__.py" else src.read(name)
            dst.writestr(name, data)
    assert ws.record_problems(tampered) == [
        f"{whl.name}: fakenixl/__init__.py does not match its RECORD line"
    ]


def test_an_unstripped_nixl_wheel_is_refused(tmp_path: Path) -> None:
    name = "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    _fake_wheel(tmp_path / name, {"nixl_ep_cu13/__init__.py": b"", "nixl_cu13/_api.py": b""})
    r = _run(sys.executable, "scripts/gpu_wheels.py", "check", "--dest", str(tmp_path))
    assert r.returncode == 1
    assert f"{name}: not stripped (1 files under nixl_ep_cu13/__init__.py)" in r.stderr
    assert f"{name}: not listed in {tmp_path / 'stripped.json'}" in r.stderr


def test_nixl_is_pinned_at_the_version_the_cpu_environment_runs() -> None:
    pins = {}
    for line in (ROOT / "scripts" / "gpu_nodeps.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed here")
    assert pins == {"nixl": metadata.version("nixl"), "nixl-cu13": metadata.version("nixl")}


def test_every_step_runs_within_the_deadline_and_the_nixl_steps_are_recorded() -> None:
    """Sourced, the check's ``step`` records exit statuses (124: its limit), cuts a limit to
    the time left and skips a step past the deadline; without NIXL its six steps are
    recorded as skipped, not left out."""
    script = (
        "source scripts/gpu_check.sh; DEADLINE=$(($(date +%s) + 40)); "
        "step ok 5 true; step bad 5 false; step hang 1 sleep 5; step cut 100 true; "
        "DEADLINE=$(date +%s); step late 5 true; NIXL_SITE=0; nixl_steps /nonexistent; "
        'printf "%s\\n" "${STEPS[@]}"; echo "failed=$FAILED"'
    )
    r = _run("bash", "-c", script, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"=== gpu-check: cut \(limit 2[0-5]s\)", r.stdout), r.stdout  # not 100
    rows = [line.rsplit(" ", 1)[0] for line in r.stdout.splitlines() if not line.startswith("=")]
    assert rows == [
        "ok 0", "bad 1", "hang 124", "cut 0", "late skipped", "nixl_import skipped",
        "nixl_tests skipped", "nixl_bench skipped", "nixl_bench_tls skipped",
        "region_bench_nixl skipped", "region_bench_nixl_tls skipped",
        "region_bench_nixl_write skipped", "failed=1",
    ]  # fmt: skip


def test_gpu_steps_selects_the_steps_that_run() -> None:
    """``GPU_STEPS`` (a regex of step names) runs only those; the others are recorded as
    deselected, which fails nothing."""
    script = (
        "source scripts/gpu_check.sh; DEADLINE=$(($(date +%s) + 40)); GPU_STEPS='nixl.*|b'; "
        "step a 5 false; step b 5 true; step nixl_bench 5 true; step ab 5 false; "
        'printf "%s\\n" "${STEPS[@]}"; echo "failed=$FAILED"'
    )
    r = _run("bash", "-c", script, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.rsplit(" ", 1)[0] for line in r.stdout.splitlines() if not line.startswith("=")]
    assert rows == ["a deselected", "b 0", "nixl_bench 0", "ab deselected", "failed=0"]
