"""Grouped bar charts of benchmark rows (PNG beside the JSON), or none without matplotlib
(the GPU machine's wheel set has none)."""

from __future__ import annotations

from pathlib import Path


def grouped_bars(
    path: Path,
    labels: list[str],
    series: list[tuple[str, list[float]]],
    ylabel: str,
    title: str,
    *,
    width: float = 6.0,
    label_size: float = 10.0,
) -> bool:
    """One group of bars per label, one bar per ``(name, values)`` series; False (nothing
    drawn) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4))
    x = list(range(len(labels)))
    w = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series):
        offset = (j - (len(series) - 1) / 2) * w
        ax.bar([p + offset for p in x], values, w, label=name)
    ax.set_xticks(x, labels, fontsize=label_size)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
