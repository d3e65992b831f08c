"""The two demos, headless and short, as CI runs them: exit code, outputs, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PD_DEMO = REPO / "examples" / "disaggregated_prefill" / "run_demo.py"
AR_DEMO = REPO / "examples" / "ar_to_diffusion" / "run_demo.py"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, pgid)`` of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _live_in_groups(pgids: set[int]) -> list[str]:
    out = []
    for pid in _pids():
        st = _stat(pid)
        if st is not None and st[0] != "Z" and st[1] in pgids:
            out.append(f"{pid}: {_cmdline(pid)[:200]}")
    return out


def _procs_mentioning(text: str) -> set[int]:
    return {pid for pid in _pids() if pid != os.getpid() and text in _cmdline(pid)}


def _run_demo(cmd: list[str], tmp: Path, timeout: float) -> tuple[int, str, str]:
    """Run a demo in its own session; on timeout interrupt it (it cleans up), then kill."""
    out, err = tmp / "demo.stdout", tmp / "demo.stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, cwd=REPO, start_new_session=True, text=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # both demos stop what they started on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            pytest.fail(
                f"{cmd[1]} did not finish in {timeout:.0f}s\n--- stdout ---\n"
                f"{out.read_text()[-4000:]}\n--- stderr ---\n{err.read_text()[-4000:]}"
            )
    return rc, out.read_text(), err.read_text()


def test_pd_demo_quick(tmp_path: Path) -> None:
    model_dir = str(REPO / ".cache" / "tiny-models" / "demo-pd")
    before = _procs_mentioning(model_dir)  # e.g. a `make demo` someone else is running
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, str(PD_DEMO),
        "--quick",
        "--json", str(summary_path),
        "--log-dir", str(tmp_path / "logs"),
        "--timeout", "300",
    ]  # fmt: skip
    rc, out, err = _run_demo(cmd, tmp_path, timeout=480)
    context = f"exit code {rc}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
    assert summary_path.exists(), f"the demo wrote no JSON summary\n{context}"
    summary = json.loads(summary_path.read_text())

    # nothing the demo started is left: not its process groups, not any server of its model
    pgids = {p["pid"] for p in summary["processes"]}
    assert not _live_in_groups(pgids), f"left running: {_live_in_groups(pgids)}"
    leftover = _procs_mentioning(model_dir) - before
    assert not leftover, f"vLLM processes left running: {[_cmdline(p) for p in leftover]}"

    assert rc == 0, f"{summary.get('error')}\n{context}"
    assert summary["ok"] is True and summary["exit_code"] == 0, summary.get("error")
    # the reference is the producer asked directly: no fourth server
    assert summary["reference"] == "producer"
    names = sorted(p["name"] for p in summary["processes"])
    assert names == ["consumer", "producer", "proxy"], summary["processes"]
    assert summary["backend"] == "shm"
    reqs = summary["requests"]
    assert len(reqs) == 2 and {r["kind"] for r in reqs} == {"completion", "chat"}, reqs
    assert summary["all_matched"] is True
    for r in reqs:
        assert r["match"] is True, r
        assert r["pd"]["token_ids"] == r["colocated"]["token_ids"], r
        assert len(r["pd"]["token_ids"]) == summary["max_tokens"], r
        assert r["pd"]["text"] == r["colocated"]["text"], r
        assert r["pd"]["kv_ok"] is True and r["pd"]["kv_bytes"] > 0, r["pd"]
        # every prompt token's KV came from the producer (none were cached on the consumer)
        assert r["pd"]["kv_tokens"] == r["prompt_tokens"], r["pd"]
        assert r["pd"]["ttft_s"] is not None and r["pd"]["ttft_s"] > 0, r["pd"]
        assert r["colocated"]["ttft_s"] is not None and r["colocated"]["ttft_s"] > 0
    totals = summary["totals"]
    assert totals["matched"] == totals["requests"] == 2
    assert totals["kv_bytes"] == sum(r["pd"]["kv_bytes"] for r in reqs)
    assert "OK: all 2 P/D answers are token-identical" in out, context
    assert "waiting for health" in out or "healthy after" in out, context


def test_ar_to_diffusion_demo(tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "image.png"
    rc, out, err = _run_demo(
        [sys.executable, str(AR_DEMO), "--out", str(png)], tmp_path, timeout=300
    )
    context = f"exit code {rc}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
    assert rc == 0, context
    assert png.is_file(), f"no PNG at {png}\n{context}"
    with Image.open(png) as im:
        im.verify()  # a complete, uncorrupted PNG
    with Image.open(png) as im:
        assert im.format == "PNG"
        assert im.size == (256, 256), im.size
    assert "no vLLM imported: True" in out, context
