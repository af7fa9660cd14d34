"""PNG figures from metrics inputs (timelines, summaries, capacity tables); matplotlib only here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from carpool.harness.metrics import RequestTimeline, tbts


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def tbt_cdf(runs: dict[str, list[RequestTimeline]], path: str | Path, slo: float | None = None,
            title: str = "TBT CDF") -> Path:
    """One CDF of all TBTs per label (log x), with the SLO as a vertical line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, timelines in runs.items():
        gaps = np.sort([g for t in timelines for g in tbts(t)])
        if gaps.size:
            ax.plot(gaps * 1e3, np.arange(1, gaps.size + 1) / gaps.size, label=label)
    if slo is not None:
        ax.axvline(slo * 1e3, color="k", ls="--", lw=1, label=f"SLO {slo * 1e3:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("fraction of TBTs")
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def token_timeline(runs: dict[str, list[RequestTimeline]], path: str | Path, stall_threshold: float | None,
                   max_requests: int = 40, window: tuple[float, float] | None = None) -> Path:
    """Per request: a grey line while it waits, a tick per output token, and red bars over gaps
    above `stall_threshold` -- generation stalls show as red (cf. Sarathi-Serve Figure 1a).
    One panel per label; times relative to each run's first arrival."""
    plt = _plt()
    rows = max([min(len(t), max_requests) for t in runs.values()] or [1])
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, len(runs) * (1.0 + 0.14 * max(rows, 8))), squeeze=False)
    for ax, (label, timelines) in zip(axes[:, 0], runs.items()):
        origin = min((t.arrival_time for t in timelines), default=0.0)
        shown = timelines[:max_requests]
        for y, t in enumerate(shown):
            times = np.asarray(t.token_times) - origin
            arrive = t.arrival_time - origin
            end = times[0] if times.size else (t.finished_time or t.arrival_time) - origin
            ax.plot([arrive, end], [y, y], color="0.75", lw=1.5, solid_capstyle="butt")
            if times.size:
                ax.scatter(times, np.full(times.size, y), marker="|", s=20, color="tab:blue", linewidths=0.6)
                if stall_threshold is not None and times.size > 1:
                    gaps = np.diff(times)
                    for a, g in zip(times[:-1][gaps > stall_threshold], gaps[gaps > stall_threshold]):
                        ax.plot([a, a + g], [y, y], color="tab:red", lw=2.5, solid_capstyle="butt")
        ax.set_ylim(len(shown), -1)
        if window:
            ax.set_xlim(*window)
        ax.set_ylabel("request")
        stalls = sum(int(np.sum(np.diff(t.token_times) > stall_threshold)) for t in timelines
                     if stall_threshold is not None and len(t.token_times) > 1)
        thr = f", red = gap > {stall_threshold * 1e3:.0f} ms ({stalls} stalls)" if stall_threshold else ""
        ax.set_title(f"{label}: grey = waiting for first token, blue = tokens{thr}", fontsize=9)
    axes[-1, 0].set_xlabel("time since first arrival (s)")
    return _save(fig, path)


def capacity_bars(table: dict[str, dict[str, float]], path: str | Path, title: str = "Capacity") -> Path:
    """Grouped bars: table[slo_name][scheduler_label] = capacity in QPS."""
    plt = _plt()
    slos = list(table)
    labels = list(dict.fromkeys(lbl for row in table.values() for lbl in row))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(slos) * max(1, len(labels)) / 2, 4))
    width = 0.8 / max(1, len(labels))
    x = np.arange(len(slos))
    for i, lbl in enumerate(labels):
        vals = [table[s].get(lbl, np.nan) for s in slos]
        bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, vals, width, label=lbl)
        for b, v in zip(bars, vals):
            if np.isfinite(v):
                ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{s} SLO" for s in slos])
    ax.set_ylabel("capacity (QPS)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def latency_vs_qps(curves: dict[str, list[dict]], path: str | Path, tbt_slo: float | None = None) -> Path:
    """TTFT P99 and TBT P99 against the request rate; curves[label] = [{qps, ttft_p99, tbt_p99}]."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, points in curves.items():
        pts = sorted((p for p in points if p.get("qps")), key=lambda p: p["qps"])
        q = [p["qps"] for p in pts]
        a1.plot(q, [p.get("ttft_p99") for p in pts], "o-", label=label)
        a2.plot(q, [None if p.get("tbt_p99") is None else p["tbt_p99"] * 1e3 for p in pts], "o-", label=label)
    if tbt_slo is not None:
        a2.axhline(tbt_slo * 1e3, color="k", ls="--", lw=1, label="TBT SLO")
    a1.set(xlabel="QPS", ylabel="TTFT P99 (s)", title="TTFT P99 vs load", yscale="log")
    a2.set(xlabel="QPS", ylabel="TBT P99 (ms)", title="TBT P99 vs load", yscale="log")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    return _save(fig, path)
