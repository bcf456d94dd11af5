"""relay/orchestrator/joint_plan.py: several relays' remaining sessions on the cap's slots and one weekly quota."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from relay.orchestrator.joint_plan import plan_jointly

NOW = datetime(2026, 1, 3, tzinfo=timezone.utc)
H = 3600.0


def _overlap(order) -> int:
    events = sorted([(s, 1) for _, s, _ in order] + [(e, -1) for _, _, e in order], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    return peak


def test_cap_fairness_and_one_quota_wait_for_all():
    needs = {"a": [H] * 3, "b": [H] * 3, "c": [H] * 3}
    refresh = NOW + timedelta(days=2)
    plan = plan_jointly(needs, now=NOW, cap=2, quota_left_s=5 * H, quota_allowed_s=30 * H, refresh_at=refresh,
                        running=["a"])
    assert _overlap(plan.order) <= 2
    before = [(n, s) for n, s, _ in plan.order if s < refresh]
    assert len(before) == 5  # a (running) + 4 more hours fit in the 5 h left; then everyone waits
    assert plan.quota_waits == [refresh]
    assert all(s >= refresh for _, s, _ in plan.order[5:])
    # fair: by the wait, every relay had at least one session and none more than one ahead
    counts = {n: sum(1 for m, _ in before if m == n) for n in needs}
    assert min(counts.values()) >= 1 and max(counts.values()) - min(counts.values()) <= 1
    assert plan.eta_all == max(plan.eta.values()) and set(plan.eta) == set(needs)


def test_enough_quota_no_wait_and_eta_is_the_parallel_finish():
    plan = plan_jointly({"a": [H, H], "b": [H, H]}, now=NOW, cap=2, quota_left_s=30 * H, quota_allowed_s=30 * H,
                        refresh_at=NOW + timedelta(days=7), handoff_s=600)
    assert plan.quota_waits == []
    assert plan.eta["a"] == plan.eta["b"] == NOW + timedelta(seconds=2 * H + 600)


def test_cap_below_one_is_refused():
    with pytest.raises(ValueError):
        plan_jointly({"a": [H]}, now=NOW, cap=0, quota_left_s=H, quota_allowed_s=H, refresh_at=NOW)


def test_a_running_session_reserved_by_kaggle_is_counted_once():
    # Kaggle's timeReserved holds the running session's hour (kaggle-cli #1029): left 5 h is after it. Counted again
    # as its own budget, only 4 more sessions would fit before the refresh; counted once, 5 do.
    needs = {"a": [H] * 3, "b": [H] * 3, "c": [H] * 3}
    refresh = NOW + timedelta(days=2)
    plan = plan_jointly(needs, now=NOW, cap=2, quota_left_s=5 * H, quota_allowed_s=30 * H, refresh_at=refresh,
                        running=["a"], reserved_s=H)
    before = [(n, s) for n, s, _ in plan.order if s < refresh]
    assert len(before) == 6  # the running one (reserved) + 5 more hours in the 5 h left
    # reserved beyond the running session's budget (another account session, a deleted one) is not handed back
    other = plan_jointly(needs, now=NOW, cap=2, quota_left_s=5 * H, quota_allowed_s=30 * H, refresh_at=refresh,
                         running=["a"], reserved_s=3 * H)
    assert len([1 for _, s, _ in other.order if s < refresh]) == 6
