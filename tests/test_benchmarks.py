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


def test_gpu_copy_bench_runs_its_paths_on_the_host(tmp_path: Path) -> None:
    """The GPU staging benchmark's code paths, on ``--device cpu`` (its numbers come only
    from a run on a GPU)."""
    out = tmp_path / "gpu_copy_bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_copy_bench.py"), "--device", "cpu"]
        + ["--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    paths = {r["path"] for r in result["rows"]}
    assert {"staged D2H (registered host)", "inject H2D (registered host)"} <= paths
    assert all(r["gbps"] > 0 for r in result["rows"])


def test_pd_load_table_and_ratios_come_from_the_json() -> None:
    """``pd_load.py``: ratios against colocated, colocated-equal texts and the README table
    (a configuration that could not run shows its recorded reason)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import pd_load
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    row = {"completed": 4, "failed": 0, "request_throughput": 2.0, "p99_ttft_ms": 90.0}
    results: dict[str, dict[str, object]] = {
        "colocated": {**row, "p50_ttft_ms": 40.0, "output_throughput": 100.0,
                      "generated_texts": ["a", "b", "c", "d"]},
        "omnikv_shm": {**row, "p50_ttft_ms": 10.0, "output_throughput": 150.0,
                       "generated_texts": ["a", "b", "x", "d"]},
        "nixl_connector": {"error": "import nixl._api failed: boom"},
    }  # fmt: skip
    pd_load.summarize(results)
    assert results["omnikv_shm"]["vs_colocated"] == {
        "p50_ttft_ms": 0.25,
        "p99_ttft_ms": 1.0,
        "output_throughput": 1.5,
    }
    assert results["omnikv_shm"]["texts_equal_to_colocated"] == 3
    assert "generated_texts" not in results["colocated"]
    workload = {"num_prompts": 4, "concurrency": 2, "seed": 0, "input_len": 8}
    workload |= {"output_len": 4, "model": "m", "host_cpus": 2}
    md = pd_load.table({"workload": workload, "results": results})
    lines = md.splitlines()
    shm = next(ln for ln in lines if ln.startswith("| OmniKVConnector, shared memory"))
    assert "| 10.0 / 90.0 |" in shm and "| 3/4 |" in shm and "| 0.25× |" in shm, shm
    assert any("could not run: import nixl._api failed: boom" in ln for ln in lines), md
