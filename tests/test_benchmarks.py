"""The benchmarks still run end to end (tiny sizes; numbers are not asserted here)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from _bench import run_bench
from _models import REPO

from vllm_omni_kv.backends.shm import arena


@pytest.mark.slow
def test_transfer_bench_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "transfer_bench.json"
    run_bench("transfer_bench.py", "--quick", "--no-mooncake", "--out", str(out))
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
    run_bench("gpu_copy_bench.py", "--device", "cpu", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    paths = {r["path"] for r in result["rows"]}
    assert {"staged D2H (registered host)", "inject H2D (registered host)"} <= paths
    assert all(r["gbps"] > 0 for r in result["rows"] if "gbps" in r)
    judged = [r for r in result["rows"] if r["target"] is not None]
    assert {r["path"] for r in judged} >= {
        "staged D2H (registered host)",
        "fixed cost: inject H2D (registered host)",
    }
    assert all(isinstance(r["meets_target"], bool) for r in judged)


def test_gpu_copy_bench_judges_each_row_against_issue_30s_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Targets (issue 30): staged D2H and inject H2D >= 85% of the pinned copy from 16 MiB
    on, >= 60% below; frame pack >= 70%; fixed cost <= 0.2 ms; limits carry none. Without
    CUDA the benchmark stops with a message instead of measuring."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_copy_bench as g
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def met(path: str, mib: float, ratio: float) -> object:
        return g.judge({"path": path, "mib": mib, "ratio_to_pinned": ratio})["meets_target"]

    staged, inject = "staged D2H (registered host)", "inject H2D (registered host)"
    assert met(staged, 16, 0.86) is True and met(staged, 256, 0.84) is False
    assert met(inject, 1, 0.61) is True and met(inject, 4, 0.59) is False
    assert met(inject, 64, 0.7) is False
    assert met("frame pack (staged + xxh3)", 64, 0.71) is True
    assert met("frame pack (staged + xxh3)", 1, 0.69) is False
    assert met("pinned D2H", 16, 1.0) is None
    rows = [
        {"path": staged, "mib": 1.0, "overhead_ms": 0.15},
        {"path": staged, "mib": 16.0, "overhead_ms": 3.0},
        {"path": inject, "mib": 1.0, "overhead_ms": 0.25},
    ]
    fixed = {r["path"]: (r["ms"], r["meets_target"]) for r in g.fixed_costs(rows)}
    assert fixed == {f"fixed cost: {staged}": (0.15, True), f"fixed cost: {inject}": (0.25, False)}
    # 1 MiB: one 32 KiB page (2 KV heads) per layer; from 4 MiB on 128 KiB pages
    assert [g.geometry(m) for m in (1, 4, 16, 256)] == [(2, 1), (8, 1), (8, 4), (8, 64)]
    monkeypatch.setattr(g.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        g.main(["--out", str(tmp_path / "none.json")])
    assert not (tmp_path / "none.json").exists()


def test_pd_load_table_and_ratios_come_from_the_json() -> None:
    """``pd_load.py``: ratios against colocated, colocated-equal texts and the docs table
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


@pytest.mark.slow
def test_one_copy_bench_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    """``one_copy_bench.py --quick``: the one-copy moves ran (the copied pages are compared
    with the producer's inside the run), each against a memcpy of the same bytes, beside
    the two-copy move; no file is left in /dev/shm under the benchmark's namespaces."""
    out = tmp_path / "one_copy_bench.json"
    run_bench("one_copy_bench.py", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["size_mib"] for r in rows} == {4.0}
    assert len(result["load_average"]["before"]) == 3
    for size in (4.0,):
        mine = {r["path"]: r for r in rows if r["size_mib"] == size}
        memcpy = mine["memcpy"]
        assert memcpy["bytes"] == size * 2**20 and memcpy["gbps"] > 0.1
        moves = [mine[p] for p in mine if "-copy " in p]
        assert len(moves) == 4, sorted(mine)
        for r in moves:  # a copy of `bytes` cannot beat memcpy by 3x, nor take a second
            assert r["bytes"] == memcpy["bytes"]
            assert 0 < r["fraction_of_memcpy"] < 3 and r["seconds"] < 1.0, r
            assert len(r["fraction_samples"]) >= 1
        # the same memcpy with the caches evicted first, the moves against it, the target
        assert mine["memcpy, caches evicted first"]["bytes"] == memcpy["bytes"]
        assert all(0 < r["fraction_of_cold_memcpy"] < 3 for r in moves if "one-copy" in r["path"])
        default = mine["one-copy move (share_cache), no verify"]
        assert default["target"] == 0.5
        assert default["meets_target"] == (default["fraction_of_memcpy"] >= 0.5)
        verify = mine["one-copy move (share_cache), verify"]
        assert verify["phases_s"]["SharedPagesPlan.apply"] <= verify["seconds"]
        # adding the producer's time (hold, digests, put) can only lower the ratio
        assert 0 < verify["end_to_end_fraction_of_memcpy"] < verify["fraction_of_memcpy"]
        assert mine["profile"]["steps_s"]["copy_pages, verify"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    namespaces = {ns for r in rows for ns in r.get("namespaces", [])}
    assert len(namespaces) == 2  # one pair for the size, one two-copy namespace
    left = [f for ns in namespaces for f in arena.namespace_files(ns)]
    assert not left, left


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shm", "mooncake_cache", "nixl_cache"])
def test_region_bench_moves_pages_against_its_limit(tmp_path: Path, backend: str) -> None:
    """``region_bench.py`` on the host (what ``make gpu-check`` runs with ``cuda_ipc``): every
    move copies the request's pages out of another process's cache, hold released, and is
    compared with its path's limit measured in the same run."""
    if backend != "shm":
        pytest.importorskip("mooncake.engine" if backend == "mooncake_cache" else "nixl")
    out = tmp_path / "region_bench.json"
    args = ("--device", "cpu", "--backend", backend, "--sizes", "2", "--repeats", "2")
    run_bench("region_bench.py", *args, "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    pages = (2 << 20) // (8 * 8 * 16 * 256 * 2)  # 64 KiB pages of 8 layers
    assert row["backend"] == backend and row["bytes"] == pages * 8 * 8 * 16 * 256 * 2
    assert row["move_ms"] > 0 and row["baseline_ms"] > 0 and row["vs_baseline"] > 0
    assert row["target"] is None and row["meets_target"] is None  # issue 30: cuda_ipc only
    assert json.loads(out.read_text())["error"] is None


def test_a_failed_region_bench_writes_its_json_with_the_failure(tmp_path: Path) -> None:
    """A move that fails (here ``cuda_ipc`` without CUDA) ends the run with exit 1 and a
    JSON that names the failure (rows measured before it are kept)."""
    out = tmp_path / "region_bench.json"
    args = ("--device", "cpu", "--backend", "cuda_ipc", "--sizes", "2", "--repeats", "1")
    run_bench("region_bench.py", *args, "--out", str(out), timeout=120, returncode=1)
    result = json.loads(out.read_text())
    assert result["rows"] == [] and "needs a CUDA device" in result["error"], result


def test_region_bench_targets_are_issue_30s() -> None:
    """``cuda_ipc`` moves of 16 MiB and more: at least 70% of a device-to-device copy."""
    spec = importlib.util.spec_from_file_location(
        "region_bench", REPO / "benchmarks/region_bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [bench.target_of("cuda_ipc", "cuda", m) for m in (1, 15, 16, 256)] == [
        None,
        None,
        0.70,
        0.70,
    ]
    assert (
        bench.target_of("cuda_ipc", "cpu", 64) is None and bench.target_of("shm", "cpu", 64) is None
    )


def test_weights_digest_bench_times_cold_warm_and_cached(tmp_path: Path) -> None:
    out = tmp_path / "weights_digest_bench.json"
    args = ("--gib", "0.01", "--dir", str(tmp_path), "--out", str(out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's package
    run_bench("weights_digest_bench.py", *args, timeout=120, env=env)
    r = json.loads(out.read_text())
    assert r["file_bytes"] > 10 << 20 and r["cold_s"] > 0 and r["warm_s"] > 0
    # a run, not a speed claim: at 10 MiB a cache lookup's fixed cost is about a hash of the
    # file, and a loaded machine orders them either way (the full-size JSON holds the speeds)
    assert r["cached_s"] > 0 and r["first_with_cache_s"] > 0
