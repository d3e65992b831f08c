"""``benchmarks/nixl_bench.py --quick`` runs end to end and writes its JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _bench import run_bench

pytest.importorskip("nixl", reason="nixl is not installed (pip install nixl)")

pytestmark = [pytest.mark.slow, pytest.mark.nixl]


def test_nixl_bench_quick_writes_json_and_plot(tmp_path: Path) -> None:
    run_bench("nixl_bench.py", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "nixl_bench_quick.json").read_text())
    assert [row["mib"] for row in result["rows"]] == [1, 4] and result["error"] is None
    for row in result["rows"]:
        # a frame is the payload plus its prelude, header and digests
        assert row["frame_bytes"] > row["mib"] << 20
        assert min(row["pull_ms"], row["raw_nixl_ms"], row["memcpy_ms"], row["put_ms"]) > 0
        # NIXL's best is the faster of its own READ and WRITE of the same bytes
        assert row["raw_write_error"] is None and row["raw_write_ms"] > 0
        assert row["raw_best_ms"] == min(row["raw_nixl_ms"], row["raw_write_ms"])
        assert row["pull_vs_best"] == pytest.approx(row["raw_best_ms"] / row["pull_ms"])
    assert (tmp_path / "nixl_bench_quick.png").stat().st_size > 0
