"""``benchmarks/small_get_bench.py --quick`` runs end to end on the installed pull engines
and writes its JSON and plot (numbers are not asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _bench import run_bench

pytestmark = pytest.mark.slow

INSTALLED = [
    e for e, mod in (("nixl", "nixl"), ("mooncake_te", "mooncake")) if importlib.util.find_spec(mod)
]


@pytest.mark.skipif(not INSTALLED, reason="neither NIXL nor Mooncake is installed")
def test_small_get_bench_quick_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    run_bench("small_get_bench.py", "--quick", "--engines", *INSTALLED, "--out", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert sorted({row["engine"] for row in rows}) == sorted(INSTALLED)
    for row in rows:
        # a 4 KiB payload's frame comes with the acquire reply, a 24 KiB one is pulled
        assert row["kind"] == "frame"
        assert row["inline"] == (row["kib"] == 4) == (row["bytes"] <= result["inline_max"])
        assert min(row["get_ms"], row["ping_ms"], row["raw_read_ms"]) > 0
        assert row["get_p90_ms"] >= row["get_ms"] and row["raw_read_p90_ms"] >= row["raw_read_ms"]
        assert row["limit_ms"] == pytest.approx(2 * row["ping_ms"], abs=1e-3)
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".png").stat().st_size > 0
