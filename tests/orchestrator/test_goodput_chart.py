"""relay.orchestrator.goodput_chart: the goodput ledger drawn, one bar per attempt split by where its GPU time went.
The figure is inspected before it is saved (report.save_figure intercepted), so the bars are checked as numbers."""
from __future__ import annotations

import pytest

from relay.orchestrator import goodput_chart, report
from relay.orchestrator.goodput import CATEGORIES, AttemptLedger, Ledger


def attempt(run_id: str, **seconds: float) -> AttemptLedger:
    split = {c: seconds.get(c.replace(" ", "_").replace("-", "_"), 0.0) for c in CATEGORIES}
    return AttemptLedger(run_id, sum(split.values()), split)


FAULTED = Ledger([
    attempt("r-s001-a1", start_up=240, training_kept=40_000, saving=300, final_tail=60, shut_down=30),
    attempt("r-s002-a1", start_up=250, training_kept=20_000, training_redone=1800, saving=200),
    attempt("r-s003-a1", start_up=200, training_kept=3000, wedged=7000, other=20),
    attempt("r-s003-a2", failed_attempt=900),  # a retried attempt that handed nothing over
])
CLEAN = Ledger([attempt("demo-s001-a1", start_up=1.0, training_kept=4.6, saving=0.04),
                attempt("demo-s002-a1", start_up=0.9, training_kept=3.2, final_tail=0.1)])


@pytest.fixture
def drawn(monkeypatch):
    figures, save = [], report.save_figure
    monkeypatch.setattr(report, "save_figure", lambda fig, out, **kw: figures.append(fig) or save(fig, out, **kw))
    return figures


def test_each_bar_is_its_attempts_charge_split_in_the_ledgers_order(drawn, tmp_path):
    png = goodput_chart.plot_goodput(FAULTED, tmp_path / "goodput.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn[0].axes[0]
    assert ax.get_xlabel() == "GPU time charged (h)"  # 11 h sessions are drawn in hours
    charged = [c for c in CATEGORIES if FAULTED.totals[c] > 0]
    assert [b.get_label().split(" ")[0] for b in ax.containers] == [c.split(" ")[0] for c in charged]
    for category, bars in zip(charged, ax.containers):
        for a, bar in zip(FAULTED.attempts, bars):
            assert bar.get_width() == pytest.approx(a.seconds[category] / 3600)
            assert bar.get_x() == pytest.approx(sum(a.seconds[c] for c in CATEGORIES[:CATEGORIES.index(category)]) / 3600)
    for row, a in enumerate(FAULTED.attempts):  # each bar ends at the attempt's charge
        ends = [bars[row].get_x() + bars[row].get_width() for bars in ax.containers]
        assert max(ends) == pytest.approx(a.charged_s / 3600)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "wedged 1h56m (9%)" in labels  # 7000 of 74000 s and "shut-down 30s (<1%)" in labels
    assert not any(label.startswith("training redone 0s") for label in labels)
    assert f"goodput {FAULTED.goodput:.0%}" in ax.get_title()
    assert [t.get_text() for t in ax.texts][3] == "15m, 0% kept"  # the failed attempt kept nothing


def test_a_wedged_and_a_failed_attempt_are_named_beside_their_bars(drawn, tmp_path):
    ledger = Ledger([FAULTED.attempts[0], AttemptLedger("r-s003-a1", 100.0, {**dict.fromkeys(CATEGORIES, 0.0),
                                                                             "failed attempt": 60.0, "wedged": 40.0},
                                                        failed="wedged", wedged=True),
                     AttemptLedger("r-s003-a2", 50.0, {**dict.fromkeys(CATEGORIES, 0.0), "failed attempt": 50.0},
                                   failed="killed")])
    goodput_chart.plot_goodput(ledger, tmp_path / "goodput.png")
    ax = drawn[0].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["s001-a1", "s003-a1 (wedged)", "s003-a2 (failed)"]
    assert "over 3 attempts (1 session handed over, 2 failed)" in ax.get_title()


def test_short_sessions_are_drawn_in_seconds_and_nothing_charged_is_refused(drawn, tmp_path):
    goodput_chart.plot_goodput(CLEAN, tmp_path / "clean.png")
    ax = drawn[0].axes[0]
    assert ax.get_xlabel() == "GPU time charged (s)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "start-up 1.9s (19%)", "training kept 7.8s (79%)", "saving 0.0s (<1%)", "final tail 0.1s (1%)"]
    with pytest.raises(ValueError, match="nothing charged"):
        goodput_chart.plot_goodput(Ledger([]), tmp_path / "none.png")
