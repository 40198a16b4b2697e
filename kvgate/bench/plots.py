"""PNG plots of `kvgate bench serve` results (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def matplotlib_ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def ttft_cdf(series: dict[str, list[float]], path: Path, title: str = "TTFT CDF") -> Path:
    """One empirical CDF line per named list of TTFTs (ms)."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        if values:
            xs = np.sort(np.asarray(values))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib_ticker().ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib_ticker().NullFormatter())
    ax.set(xlabel="TTFT (ms, log scale)", ylabel="fraction of requests", title=title, ylim=(0, 1.01))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def against_concurrency(series: dict[str, tuple[list[int], list[float]]], ylabel: str, path: Path,
                        title: str, log_y: bool = False) -> Path:
    """One line per named (concurrency levels, values) pair."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for xs, _ in series.values() for x in xs}))
    ax.xaxis.set_major_formatter(matplotlib_ticker().ScalarFormatter())
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib_ticker().ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib_ticker().NullFormatter())
    ax.set(xlabel="concurrency (requests in flight)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def grouped_bars(groups: dict[str, dict[str, float]], ylabel: str, path: Path, title: str) -> Path:
    """Side-by-side bars: one group per key of `groups`, one bar per series inside it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = list(dict.fromkeys(name for g in groups.values() for name in g))
    width = 0.8 / max(1, len(series))
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(name, 0.0) for g in groups.values()]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_report(report: dict, folder: Path) -> list[Path]:
    """TTFT CDF of every run; for a sweep also throughput and TTFT p99 against concurrency."""
    runs = report["runs"]
    name = report["config"]["dataset"]
    label = (lambda r: f"c={r['max_concurrency']}") if len(runs) > 1 else (lambda r: name)
    paths = [ttft_cdf({label(r): r["ttfts_ms"] for r in runs}, folder / "ttft_cdf.png", f"TTFT CDF · {name}")]
    if report["config"].get("sweep"):
        levels = [r["max_concurrency"] for r in runs]
        paths.append(against_concurrency({"output tokens/s": (levels, [r["output_throughput"] for r in runs])},
                                         "output tokens/s", folder / "throughput.png", f"Throughput · {name}"))
        paths.append(against_concurrency({"TTFT p99": (levels, [r["p99_ttft_ms"] for r in runs])},
                                         "TTFT p99 (ms)", folder / "ttft_p99.png", f"TTFT p99 · {name}"))
    return paths
