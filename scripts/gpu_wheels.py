"""The wheel set `make gpu-check` installs on the GPU machine (one Python version, offline).

    python scripts/gpu_wheels.py ensure [--dest .gpu-wheels]     # `make gpu-wheels`
    python scripts/gpu_wheels.py check [--dest .gpu-wheels]      # offline
    python scripts/gpu_wheels.py download [--dest .gpu-wheels]   # needs the package index
    python scripts/gpu_wheels.py resolve                         # needs the package index

``ensure`` keeps a folder that passes ``check`` (so it runs offline on the GPU machine once
the folder is carried there) and downloads the set otherwise. ``download`` resolves
``scripts/gpu_requirements.txt`` with its dependencies for CPython 3.12 on manylinux x86_64
(binary wheels only) into a fresh folder, then replaces ``--dest`` with it, so the set never
mixes versions. ``check`` verifies, without the network, that the
folder alone resolves the requirements for that interpreter (``pip install --dry-run
--no-index --target``), that every wheel installs on it, that each project is there once,
and that the set fits the device tool's carry limit; it prints the set's size.
``resolve`` asks the package index, without downloading any wheel, whether the pinned set
resolves for that interpreter and which wheels it would take (the CI check).
Exit status 1 (with the reason on stderr) when any of that fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "scripts" / "gpu_requirements.txt"
PYTHON_VERSION = "3.12"
#: the carried tree (repository and wheels) may hold 64 MiB; the wheels get at most this
MAX_BYTES = 40 * 2**20
#: glibc 2.17 to 2.39 (the GPU machine's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39)
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def _target_args(python_version: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def download(dest: Path, python_version: str) -> None:
    """Resolve and download the set into ``dest`` (replaced whole)."""
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-wheels-", dir=dest.parent))
    try:
        r = _pip(
            "download", "-q", *_target_args(python_version), "-d", str(tmp), "-r", str(REQUIREMENTS)
        )
        if r.returncode:
            raise SystemExit(f"pip download failed:\n{r.stdout}{r.stderr}")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tags_fit(m: re.Match[str], python_version: str) -> bool:
    major, minor = (int(x) for x in python_version.split("."))
    cp = f"cp{major}{minor}"
    abis = m["abi"].split(".")
    stable = [f"cp{major}{n}" for n in range(minor + 1)] if "abi3" in abis else []
    py_ok = any(t in (cp, f"py{major}", *stable) for t in m["py"].split("."))
    abi_ok = any(t in (cp, "abi3", "none") for t in abis)
    plat_ok = any(t == "any" or t in PLATFORMS for t in m["plat"].split("."))
    return py_ok and abi_ok and plat_ok


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _file_problems(names: list[str], python_version: str) -> tuple[dict[str, str], list[str]]:
    """``(project -> version, problems)`` of wheel file names."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for fname in names:
        m = _WHEEL.match(fname)
        if m is None:
            problems.append(f"{fname}: not a wheel file name")
            continue
        name = _norm(m["name"])
        if name in seen:
            problems.append(f"{name}: two versions ({seen[name]}, {m['ver']})")
        seen[name] = m["ver"]
        if not _tags_fit(m, python_version):
            problems.append(f"{fname}: does not install on CPython {python_version} x86_64")
    return seen, problems


def _dry_run(python_version: str, *index: str) -> tuple[list[dict], str | None]:
    """What ``pip install --dry-run --target`` would install for that interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        r = _pip(
            "install", "--dry-run", *index, "--target", tmp, "--report", "-", "-q",
            *_target_args(python_version), "-r", str(REQUIREMENTS),
        )  # fmt: skip
    if r.returncode:
        return [], f"{r.stdout}{r.stderr}"
    return json.loads(r.stdout)["install"], None


def resolve(python_version: str) -> list[str]:
    """What is wrong with the pinned set on the package index (empty: it resolves)."""
    chosen, err = _dry_run(python_version)
    if err is not None:
        return [f"the set does not resolve for CPython {python_version}:\n{err}"]
    names = [i["download_info"]["url"].rsplit("/", 1)[-1] for i in chosen]
    _seen, problems = _file_problems(names, python_version)
    print(f"package index: {len(names)} wheels for CPython {python_version}")
    return problems


def check(dest: Path, python_version: str) -> list[str]:
    """What is wrong with the set in ``dest`` (empty: it is complete and fits)."""
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        return [f"no wheels in {dest}: run `make gpu-wheels` where the package index is reachable"]
    seen, problems = _file_problems([w.name for w in wheels], python_version)
    size = sum(w.stat().st_size for w in wheels)
    if size > MAX_BYTES:
        problems.append(f"the set is {size / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    chosen, err = _dry_run(python_version, "--no-index", "--find-links", str(dest))
    if err is not None:
        problems.append(f"the set does not resolve offline:\n{err}")
    else:
        unused = sorted(set(seen) - {_norm(i["metadata"]["name"]) for i in chosen})
        if unused:
            problems.append(f"wheels no requirement needs: {unused}")
    print(f"{dest}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, CPython {python_version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["ensure", "check", "download", "resolve"])
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    ap.add_argument("--python-version", default=PYTHON_VERSION)
    args = ap.parse_args(argv)
    if args.action == "resolve":
        problems = resolve(args.python_version)
    else:
        problems = [] if args.action == "download" else check(args.dest, args.python_version)
        if args.action == "download" or (args.action == "ensure" and problems):
            if problems:
                print(f"{args.dest}: downloading the set ({problems[0].splitlines()[0]})")
            args.dest.parent.mkdir(parents=True, exist_ok=True)
            download(args.dest, args.python_version)
            problems = check(args.dest, args.python_version)
    for p in problems:
        print(f"gpu wheels: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
