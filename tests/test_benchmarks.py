"""The benchmarks still run end to end (tiny sizes; numbers are not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _models import REPO


@pytest.mark.slow
def test_transfer_bench_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "transfer_bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "transfer_bench.py"), "--quick"]
        + ["--no-mooncake", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    paths = {r["path"] for r in rows}
    assert "memcpy" in paths
    assert "shm move, blocks, streamed (cache->cache, 2 procs)" in paths
    assert "shm move, blocks, layer parts, not streamed" in paths
    moves = [r for r in rows if r["path"].startswith("shm move")]
    assert moves and all(r["gbps"] > 0 and r["fraction_samples"] for r in moves)
    assert out.with_suffix(".png").stat().st_size > 10_000
