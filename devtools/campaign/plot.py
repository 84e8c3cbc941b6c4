"""A campaign's timeline, drawn the way Jepsen reports draw theirs (needs matplotlib, dev only).

One lane a key: each hold a bar from its acquisition to the moment its holder stopped
believing it held the key, coloured by its run's outcome; a refused (stale) write is a
black cross on its lane; each fault a shaded span with its kind written above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from devtools.campaign.checker import build

COLOURS = {"completed": "#4c9a2a", "lost": "#d62728", "failed": "#ff7f0e", "skipped": "#9e9e9e", None: "#555555"}
FAULT_COLOURS = {
    "sigkill": "#8c564b",
    "sigstop-short": "#bcbd22",
    "sigstop-long": "#e377c2",
    "netcut": "#17becf",
    "terminate": "#1f77b4",
    "cancel": "#aec7e8",
    "restart-fast": "#9467bd",
    "restart-immediate": "#c5b0d5",
    "failover": "#ff9896",
    "failover-frozen": "#d62728",
}


#: The most a picture shows: a long run's picture is the stretch around its first frozen failover.
WINDOW_SECONDS = 150.0


def timeline(events: Iterable[dict[str, Any]], writes: Sequence[tuple[Any, ...]], path: Path) -> Path:
    """Draw the timeline of ``events`` (and the register's refused ``writes``) into ``path`` (PNG).

    A run longer than :data:`WINDOW_SECONDS` is drawn from 20 s before its first
    ``failover-frozen`` (or its start) for that long.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs, faults = build(events)
    holds = [hold for run in runs.values() for hold in run.holds if hold.end != float("inf")]
    if not holds:
        raise ValueError("nothing was held: no timeline to draw")
    t0 = min(hold.acquired for hold in holds)
    frozen = [fault.start for fault in faults if fault.kind == "failover-frozen"]
    if max(hold.end for hold in holds) - t0 > WINDOW_SECONDS:
        t0 = max(t0, min(frozen) - 20) if frozen else t0
        holds = [hold for hold in holds if hold.end > t0 and hold.acquired < t0 + WINDOW_SECONDS]
        faults = [fault for fault in faults if t0 <= fault.start < t0 + WINDOW_SECONDS]
        writes = [write for write in writes if t0 <= write[5] < t0 + WINDOW_SECONDS]
    keys = sorted({hold.key for hold in holds})
    lane = {key: i for i, key in enumerate(keys)}
    width = max(12.0, (max(h.end for h in holds) - t0) / 6)
    figure, axes = plt.subplots(figsize=(min(width, 26.0), 1.2 + 0.6 * len(keys)))
    for fault in faults:
        colour = FAULT_COLOURS.get(fault.kind, "#cccccc")
        axes.axvspan(fault.start - t0, max(fault.end, fault.start + 0.3) - t0, color=colour, alpha=0.25, lw=0)
        axes.text(fault.start - t0, len(keys) - 0.3, fault.kind, rotation=90, fontsize=6, va="top", color=colour)
    for hold in holds:
        outcome = runs[hold.run].outcome
        axes.barh(
            lane[hold.key],
            min(hold.end, t0 + WINDOW_SECONDS) - max(hold.acquired, t0),
            left=max(hold.acquired, t0) - t0,
            height=0.6,
            color=COLOURS.get(outcome, "#555555"),
            edgecolor="black" if hold.token is not None else "none",
            linewidth=0.3,
        )
    refused = [(w[1], w[5]) for w in writes if not w[4] and w[1] in lane]
    if refused:
        axes.scatter([at - t0 for _, at in refused], [lane[key] for key, _ in refused], marker="x", color="black", s=18)
    axes.set_yticks(range(len(keys)), keys, fontsize=7)
    axes.set_xlabel("seconds")
    legend = [Patch(color=colour, label=str(outcome or "killed")) for outcome, colour in COLOURS.items()]
    axes.legend(handles=legend, loc="upper right", fontsize=7, ncol=len(legend))
    axes.set_title("holds by key (bar: believed held; outline: fenced; x: refused stale write; spans: faults)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
