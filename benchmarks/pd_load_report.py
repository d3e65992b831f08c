"""The report of ``pd_load.py``: ratios against colocated, the Markdown table that
docs/benchmarks.md shows, and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIGS = (
    "colocated",
    "omnikv_shm",
    "omnikv_shm_v2_calls",
    "omnikv_mooncake",
    "example_connector",
    "nixl_connector",
)

LABELS = {
    "colocated": "colocated (one server)",
    "omnikv_shm": "OmniKVConnector, shared memory",
    "omnikv_shm_v2_calls": "OmniKVConnector, shared memory, V2 runner's calls",
    "omnikv_mooncake": "OmniKVConnector, Mooncake TE (TCP loopback)",
    "example_connector": "vLLM ExampleConnector",
    "nixl_connector": "vLLM NixlConnector (UCX, CPU buffers)",
}

RATIO_KEYS = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "output_throughput")


def summarize(results: dict[str, dict[str, Any]]) -> None:
    """Colocated-equal texts and ratios against colocated, in place."""
    base = results.get("colocated", {})
    ref = base.get("generated_texts")
    for name, r in results.items():
        texts = r.pop("generated_texts", None)
        if ref and texts and len(texts) == len(ref):
            r["texts_equal_to_colocated"] = sum(int(x == y) for x, y in zip(texts, ref))
        if name != "colocated" and "error" not in r and "error" not in base:
            r["vs_colocated"] = {
                k: round(r[k] / base[k], 3) for k in RATIO_KEYS if base.get(k) and k in r
            }


def _fmt_ms(v: float | None) -> str:
    return "–" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def table(report: dict[str, Any]) -> str:
    """The Markdown table of a ``pd_load.json`` report, as docs/benchmarks.md shows it."""
    w = report["workload"]
    head = (
        f"{w['num_prompts']} requests, concurrency {w['concurrency']}, random dataset "
        f"(seed {w['seed']}, ~{w['input_len']} input / {w['output_len']} output tokens), "
        f"greedy; {w['model']}; {w['host_cpus']} CPUs"
        f"{'; ' + w['cpu_binding'] if 'cpu_binding' in w else ''}\n\n"
        "| configuration | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | requests/s | "
        "output tok/s | failed | texts = colocated | TTFT p50 vs colocated |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name in CONFIGS:
        r = report["results"].get(name)
        if r is None:
            continue
        label = LABELS[name]
        if "error" in r and "completed" not in r:
            rows.append(f"| {label} | could not run: {r['error'][:160]} | | | | | | |")
            continue
        n = w["num_prompts"]
        eq = r.get("texts_equal_to_colocated")
        ratio = r.get("vs_colocated", {}).get("p50_ttft_ms")
        rows.append(
            f"| {label} | {_fmt_ms(r.get('p50_ttft_ms'))} / {_fmt_ms(r.get('p99_ttft_ms'))} | "
            f"{_fmt_ms(r.get('p50_itl_ms'))} / {_fmt_ms(r.get('p99_itl_ms'))} | "
            f"{r.get('request_throughput', 0):.2f} | {r.get('output_throughput', 0):.1f} | "
            f"{r.get('failed', '–')}/{n} | {'–' if eq is None else f'{eq}/{n}'} | "
            f"{'–' if ratio is None else f'{ratio:.2f}×'} |"
        )
    notes = [
        f"\n{LABELS[n]}: {side} exited during the run: `{err[:300]}`"
        for n in CONFIGS
        for side, err in report["results"].get(n, {}).get("server_errors", {}).items()
    ]
    return head + "\n".join(rows) + "\n" + "".join(f"{x}\n" for x in notes)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {n: r for n, r in report["results"].items() if "completed" in r}
    names = [n for n in CONFIGS if n in res]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = ["#888888", "#2a7ab0", "#6aa9d6", "#5aa05a", "#c0504d", "#9a7ab0"]
    for ax, (k50, k99, label) in zip(
        axes,
        (
            ("p50_ttft_ms", "p99_ttft_ms", "TTFT (ms), p50 bar / p99 tick"),
            ("p50_itl_ms", "p99_itl_ms", "ITL (ms), p50 bar / p99 tick"),
            ("output_throughput", None, "output tokens/s"),
        ),
    ):
        vals = [res[n].get(k50, 0.0) for n in names]
        ax.bar(range(len(names)), vals, color=colors[: len(names)])
        if k99:
            ax.scatter(range(len(names)), [res[n].get(k99, 0.0) for n in names], marker="_", s=400)
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
        ticks = [
            n.replace("_", "\n") + (f"\n{res[n]['failed']} failed" if res[n].get("failed") else "")
            for n in names
        ]
        ax.set_xticks(range(len(names)), ticks, fontsize=8)
        ax.set_title(label, fontsize=9)
    w = report["workload"]
    fig.suptitle(
        f"vllm.benchmarks.serve through the P/D proxy: {w['num_prompts']} requests, "
        f"concurrency {w['concurrency']}, ~{w['input_len']} in / {w['output_len']} out tokens",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
