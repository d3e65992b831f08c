"""The benchmarks' smoke tests run each script as a user does: in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

from _models import REPO


def run_bench(
    script: str,
    *args: str,
    timeout: float = 300,
    returncode: int = 0,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``benchmarks/<script>`` with ``args``; fail with the end of its stderr unless it
    exits with ``returncode``."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == returncode, proc.stderr[-3000:]
