"""The goodput ledger drawn (relay/orchestrator/goodput.py computes it; this only draws): one bar per attempt, its
charged GPU-seconds split by where they went, in the ledger's order of categories; the legend gives each category's
total and share, the title the relay's goodput. `relay status`, the flow's summary artifact and `make demo` show it
beside the timeline, which says when the sessions ran, not what their time bought."""
from __future__ import annotations

from pathlib import Path

from relay.orchestrator import canvas, report
from relay.orchestrator.goodput import CATEGORIES, AttemptLedger, Ledger, duration_text, short_run_id

# Kept training green, time trained again orange, the platform's and the relay's own costs in blues and greys,
# what a fault cost in reds.
COLORS = {"start-up": "#9ecae1", "training kept": "#31a354", "training redone": "#fd8d3c", "saving": "#3182bd",
          "final tail": "#c6dbef", "wedged": "#de2d26", "shut-down": "#bdbdbd", "failed attempt": "#a50f15",
          "other": "#e0e0e0"}
assert set(COLORS) == set(CATEGORIES)


def plot_goodput(ledger: Ledger, out_png: str | Path, *, title: str = "Where the GPU time went") -> Path:
    if not ledger.attempts or ledger.charged_s <= 0:
        raise ValueError("plot_goodput: nothing charged yet")
    report.quiet_matplotlib()
    attempts = ledger.attempts
    fig, (ax,) = canvas.figure("goodput", (12, 1.7 + 0.45 * len(attempts)), report.DPI, lambda new: [new.subplots()])
    totals, charged = ledger.totals, ledger.charged_s
    longest = max(a.charged_s for a in attempts)
    unit, per = ("h", 3600.0) if longest >= 7200 else ("min", 60.0) if longest >= 120 else ("s", 1.0)
    for category in CATEGORIES:
        if totals[category] <= 0:
            continue  # in the legend only what the relay was charged for
        lefts = [sum(a.seconds.get(c, 0.0) for c in CATEGORIES[:CATEGORIES.index(category)]) / per for a in attempts]
        ax.barh(range(len(attempts)), [a.seconds.get(category, 0.0) / per for a in attempts], left=lefts,
                height=0.6, color=COLORS[category], edgecolor="0.35", linewidth=0.5,
                label=f"{category} {duration_text(totals[category])} ({_share(totals[category] / charged)})")
    for row, a in enumerate(attempts):  # each attempt's charge and the share of it kept, right of its bar
        kept = a.seconds.get("training kept", 0.0) / a.charged_s if a.charged_s > 0 else 0.0
        ax.annotate(f"{duration_text(a.charged_s)}, {_share(kept)} kept", (a.charged_s / per, row), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.2")
    ax.set_yticks(range(len(attempts)), [_label(a) for a in attempts], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.18 * longest / per)  # room for the labels
    ax.set_xlabel(f"GPU time charged ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="center left", fontsize=9, bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_title(f"{title}: goodput {ledger.goodput:.0%}, {duration_text(totals['training kept'])} of training kept"
                 f" of {duration_text(charged)} charged over {ledger.attempts_text()}", fontsize=12)
    return report.save_figure(fig, out_png)


def _label(a: AttemptLedger) -> str:
    """s003-a1 (wedged): an attempt named as the tables name it, and how it went wrong beside it."""
    how = "wedged" if a.wedged else "failed" if a.failed else ""
    return f"{short_run_id(a.run_id)} ({how})" if how else short_run_id(a.run_id)


def _share(fraction: float) -> str:
    return "<1%" if 0 < fraction < 0.005 else f"{fraction:.0%}"
