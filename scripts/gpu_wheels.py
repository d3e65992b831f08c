"""The wheel set `make gpu-check` installs on the GPU machine (one Python version, offline).

    python scripts/gpu_wheels.py ensure [--dest .gpu-wheels]     # `make gpu-wheels`
    python scripts/gpu_wheels.py check [--dest .gpu-wheels]      # offline
    python scripts/gpu_wheels.py download [--dest .gpu-wheels]   # needs the package index
    python scripts/gpu_wheels.py resolve                         # needs the package index

``ensure`` keeps a folder that passes ``check`` (so it runs offline on the GPU machine once
the folder is carried there) and downloads the set otherwise. ``download`` resolves
``scripts/gpu_requirements.txt`` with its dependencies for CPython 3.12 on manylinux x86_64
(binary wheels only) and ``scripts/gpu_nodeps.txt`` without dependencies (NIXL: its CUDA 13
build and the ``nixl`` meta package) into a fresh folder, rewrites the wheels named in
:data:`STRIP` without those files (``nixl_ep``, see ``stripped.json`` there), then replaces
``--dest`` with it, so the set never mixes versions. ``check`` verifies, without the
network, that the folder alone resolves both lists for that interpreter (``pip install
--dry-run --no-index --target``), that every wheel installs on it, that each project is
there once, that each stripped wheel lacks what was stripped, has a valid RECORD and
installs (``--no-deps`` into a scratch folder), and that the set fits the device tool's
carry limit with the repository; it prints the set's size.
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

from wheel_strip import members_under, record_problems, strip_wheel

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "scripts" / "gpu_requirements.txt"
#: installed with ``--no-deps`` (their declared dependencies: torch, and both NIXL builds)
NODEPS = ROOT / "scripts" / "gpu_nodeps.txt"
PYTHON_VERSION = "3.12"
#: the carried tree (repository and wheels) may hold this much
CARRY_BYTES = 64 * 2**20
#: the wheels get at most this; the rest is the repository's (about 3.6 MiB tracked today)
MAX_BYTES = 56 * 2**20
#: project -> the top-level folders its wheel is rewritten without: ``nixl_ep_cu13`` is
#: NIXL's expert-parallel extension (three 31 MB builds, for torch 2.12 to 2.14), which
#: nothing here imports; without it the CUDA 13 wheel is about 32 MB instead of 59 MB
STRIP = {"nixl-cu13": ("nixl_ep_cu13/",)}
#: what was stripped, written beside the wheels
STRIPPED = "stripped.json"
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
    """Resolve and download the set into ``dest`` (replaced whole), stripping :data:`STRIP`."""
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-wheels-", dir=dest.parent))
    try:
        for extra, reqs in (([], REQUIREMENTS), (["--no-deps"], NODEPS)):
            r = _pip(
                "download", "-q", *extra, *_target_args(python_version), "-d", str(tmp),
                "-r", str(reqs),
            )  # fmt: skip
            if r.returncode:
                raise SystemExit(f"pip download failed:\n{r.stdout}{r.stderr}")
        stripped = {}
        for w in sorted(tmp.glob("*.whl")):
            prefixes = STRIP.get(_project(w.name))
            if prefixes:
                stripped[w.name] = strip_wheel(w, prefixes)
        (tmp / STRIPPED).write_text(json.dumps(stripped, indent=2) + "\n")
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


def _project(fname: str) -> str:
    """The normalized project name of a wheel file name ("" when it is none)."""
    m = _WHEEL.match(fname)
    return "" if m is None else _norm(m["name"])


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
    """What ``pip install --dry-run --target`` would install for that interpreter: both
    lists, the second without dependencies."""
    chosen: list[dict] = []
    for extra, reqs in (([], REQUIREMENTS), (["--no-deps"], NODEPS)):
        with tempfile.TemporaryDirectory() as tmp:
            r = _pip(
                "install", "--dry-run", *extra, *index, "--target", tmp, "--report", "-", "-q",
                *_target_args(python_version), "-r", str(reqs),
            )  # fmt: skip
        if r.returncode:
            return [], f"{reqs.name}: {r.stdout}{r.stderr}"
        chosen += json.loads(r.stdout)["install"]
    return chosen, None


def resolve(python_version: str) -> list[str]:
    """What is wrong with the pinned set on the package index (empty: it resolves)."""
    chosen, err = _dry_run(python_version)
    if err is not None:
        return [f"the set does not resolve for CPython {python_version}:\n{err}"]
    names = [i["download_info"]["url"].rsplit("/", 1)[-1] for i in chosen]
    _seen, problems = _file_problems(names, python_version)
    print(f"package index: {len(names)} wheels for CPython {python_version}")
    return problems


def _repository_bytes() -> int | None:
    """The size of the repository's tracked files (None without git or outside a checkout)."""
    try:
        r = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    files = [ROOT / f for f in r.stdout.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def _size_problems(size: int) -> list[str]:
    """The set within :data:`MAX_BYTES`, and with the repository within :data:`CARRY_BYTES`."""
    problems = []
    if size > MAX_BYTES:
        problems.append(f"the set is {size / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    repo = _repository_bytes()
    if repo is not None:
        total = size + repo
        print(f"with the repository's tracked files ({repo / 2**20:.1f} MiB): "
              f"{total / 2**20:.1f} of {CARRY_BYTES / 2**20:.0f} MiB")  # fmt: skip
        if total > CARRY_BYTES:
            problems.append(f"set and repository are {total / 2**20:.1f} MiB, over the carry limit")
    return problems


def _stripped_problems(dest: Path, wheels: list[Path], python_version: str) -> list[str]:
    """Each wheel of :data:`STRIP` lacks what is stripped, has a valid RECORD, is listed in
    ``stripped.json`` and installs (``--no-deps``, into a scratch folder)."""
    problems: list[str] = []
    marker = dest / STRIPPED
    listed = json.loads(marker.read_text()) if marker.is_file() else {}
    todo = [w for w in wheels if _project(w.name) in STRIP]
    for w in todo:
        left = members_under(w, STRIP[_project(w.name)])
        if left:
            problems.append(f"{w.name}: not stripped ({len(left)} files under {left[0]})")
        problems += record_problems(w)
        if w.name not in listed:
            problems.append(f"{w.name}: not listed in {marker}")
    if todo and not problems:
        with tempfile.TemporaryDirectory() as tmp:
            r = _pip(
                "install", "-q", "--no-deps", "--no-index", "--target", tmp,
                *_target_args(python_version), *map(str, todo),
            )  # fmt: skip
        if r.returncode:
            problems.append(f"the stripped wheels do not install:\n{r.stdout}{r.stderr}")
    return problems


def check(dest: Path, python_version: str) -> list[str]:
    """What is wrong with the set in ``dest`` (empty: it is complete and fits)."""
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        return [f"no wheels in {dest}: run `make gpu-wheels` where the package index is reachable"]
    seen, problems = _file_problems([w.name for w in wheels], python_version)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{dest}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, CPython {python_version}")
    problems += _size_problems(size)
    chosen, err = _dry_run(python_version, "--no-index", "--find-links", str(dest))
    if err is not None:
        problems.append(f"the set does not resolve offline:\n{err}")
    else:
        unused = sorted(set(seen) - {_norm(i["metadata"]["name"]) for i in chosen})
        if unused:
            problems.append(f"wheels no requirement needs: {unused}")
    return problems + _stripped_problems(dest, wheels, python_version)


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
