"""PNG plots of benchmark runs: a per-worker timeline of requests, and latency CDFs per policy."""

from __future__ import annotations

from pathlib import Path

from tandem.loadgen.results import OK, RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline(records: list[RequestRecord], path: Path, title: str) -> None:
    """One row per request, grouped by worker: waiting (arrival to first token) light, generating dark."""
    plt = _pyplot()
    completed = sorted((r for r in records if r.status == OK), key=lambda r: (r.worker, r.arrival_s))
    workers = sorted({r.worker for r in completed})
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(workers)}
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.12 * len(completed) + 1.5)))
    for row, record in enumerate(completed):
        first = record.first_token_s if record.first_token_s is not None else record.finish_s
        ax.barh(row, first - record.arrival_s, left=record.arrival_s, color=colors[record.worker], alpha=0.3)
        ax.barh(row, record.finish_s - first, left=first, color=colors[record.worker])
    for name in workers:
        ax.barh(0, 0, color=colors[name], label=name)
    ax.set_xlabel("seconds since the first submission")
    ax.set_ylabel("request (grouped by worker)")
    ax.set_yticks([])
    ax.set_title(title)
    ax.legend(loc="lower right")
    _save(fig, path)


def latency_cdfs(runs: dict[str, list[RequestRecord]], path: Path, title: str) -> None:
    """Empirical CDFs of TTFT and end-to-end latency, one line per run label (usually a policy)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs.items():
        completed = [r for r in records if r.status == OK]
        for ax, values in ((axes[0], [r.ttft_s for r in completed if r.ttft_s is not None]),
                           (axes[1], [r.e2e_s for r in completed])):
            ordered = sorted(values)
            if ordered:
                ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)
    for ax, name in zip(axes, ("time to first token (s)", "end-to-end latency (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def lines(series: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, title: str,
          log_x: bool = False) -> None:
    """One marked line per label through its (x, y) points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
