"""relay.orchestrator.plan: session splitting, weekly quota, waits, ledger, errors."""
from __future__ import annotations

import random
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from conftest import REPO
from relay.orchestrator.plan import (HOUR, PlanError, QuotaState, SessionLimits, format_plan, last_weekly_reset,
                        measured_step_seconds, next_weekly_reset, plan_from_progress, plan_sessions,
                        quota_from_api, quota_from_ledger)

UTC = timezone.utc
TUESDAY = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
SATURDAY = datetime(2026, 11, 28, 0, 0, tzinfo=UTC)
# 12 h cap - 10 min start-up - 5 min save = 42 300 s of training per full session.
LIMITS = SessionLimits()


def quota(left_h: float, now: datetime = TUESDAY, total_h: float = 30, reserved_h: float = 0,
          refresh: datetime = SATURDAY) -> QuotaState:
    return QuotaState(total_allowed_s=total_h * HOUR, used_s=(total_h - left_h - reserved_h) * HOUR,
                      reserved_s=reserved_h * HOUR, refresh_at=refresh, observed_at=now)


def billed_per_week(plan, q: QuotaState) -> dict[int, float]:
    """GPU seconds charged to each quota week, splitting sessions that cross a refresh."""
    charged: dict[int, float] = defaultdict(float)
    for s in plan.sessions:
        t, left = s.starts, s.budget_s
        while left > 0:
            week, refresh = 1, q.refresh_at
            while refresh <= t:
                week, refresh = week + 1, refresh + timedelta(seconds=q.period_s)
            part = min(left, (refresh - t).total_seconds())
            charged[week] += part
            t, left = refresh, left - part
    return charged


def test_uneven_division_gives_a_shorter_last_session():
    plan = plan_sessions(10_000, 10.0, quota(30), TUESDAY)
    assert [s.steps for s in plan.sessions] == [4230, 4230, 1540]
    assert [s.budget_s for s in plan.sessions[:2]] == [12 * HOUR, 12 * HOUR]
    assert plan.sessions[-1].budget_s == 600 + 1540 * 10 + 300
    assert plan.sessions[-1].step_end == 10_000
    # Sessions chain: each starts a handoff after the previous one ends.
    assert plan.sessions[1].starts == plan.sessions[0].ends + timedelta(seconds=LIMITS.handoff_s)
    assert plan.finish == plan.sessions[-1].ends
    assert plan.state == "ready" and plan.waiting_until is None


def test_session_shorter_than_an_epoch_ends_mid_epoch():
    plan = plan_sessions(50_000, 10.0, quota(30), TUESDAY, steps_per_epoch=20_000, done_steps=2_000)
    first = plan.sessions[0]
    assert first.step_start == 2_000 and first.step_end == 6_230
    assert first.epoch_end == pytest.approx(0.3115)
    assert sum(s.steps for s in plan.sessions) == 50_000
    assert plan.sessions[-1].epoch_end == pytest.approx(2.6)


def test_exhausted_quota_waits_until_the_refresh():
    plan = plan_sessions(10_000, 10.0, quota(0.3), TUESDAY)
    assert plan.state == "waiting"
    assert plan.waiting_until == SATURDAY
    assert plan.sessions[0].starts == SATURDAY and plan.sessions[0].week == 2
    assert "waiting for quota until Sat 2026-11-28 00:00 UTC" in format_plan(plan)


def test_reserved_time_counts_against_the_quota():
    assert plan_sessions(10_000, 10.0, quota(0.3, reserved_h=0), TUESDAY).state == "waiting"
    assert plan_sessions(100, 10.0, quota(2, reserved_h=0), TUESDAY).state == "ready"
    q = QuotaState(total_allowed_s=30 * HOUR, used_s=28 * HOUR, reserved_s=1.8 * HOUR,
                   refresh_at=SATURDAY, observed_at=TUESDAY)
    assert q.remaining_s == pytest.approx(0.2 * HOUR)
    assert plan_sessions(10_000, 10.0, q, TUESDAY).state == "waiting"


def test_leftover_quota_is_used_when_worth_it_and_the_rest_waits():
    plan = plan_sessions(20_000, 10.0, quota(20), TUESDAY)
    first, second, third = plan.sessions[:3]
    assert first.budget_s == 12 * HOUR and not first.waited_for_quota
    assert second.budget_s == 8 * HOUR and not second.waited_for_quota  # the 8 h left this week
    assert third.starts == SATURDAY and third.waited_for_quota and third.week == 2


def test_small_final_session_fits_leftover_quota_without_waiting():
    plan = plan_sessions(300, 10.0, quota(1.2), TUESDAY)
    assert plan.state == "ready" and len(plan.sessions) == 1
    assert plan.sessions[0].budget_s == 600 + 3000 + 300


def test_a_plan_spanning_several_weeks_respects_each_weeks_quota():
    q = quota(30)
    plan = plan_sessions(200_000, 10.0, q, TUESDAY)  # ~556 GPU hours: many weeks
    weeks = billed_per_week(plan, q)
    assert max(plan.sessions[-1].week, *weeks) >= 18
    assert all(v <= q.total_allowed_s + 1e-6 for v in weeks.values())
    assert sum(s.steps for s in plan.sessions) == 200_000
    for s in plan.sessions:
        assert s.week >= 1 and s.budget_s <= LIMITS.session_cap_s


def test_session_running_past_the_refresh_bills_the_next_week():
    friday_8pm = SATURDAY - timedelta(hours=4)
    q = quota(10, now=friday_8pm)
    plan = plan_sessions(40_000, 10.0, q, friday_8pm)
    first, second, third = plan.sessions[:3]
    # 10 h left covers the 4 h until the refresh, so a full 12 h session runs; 8 h of it bill week 2.
    assert first.budget_s == 12 * HOUR and first.week == 1
    assert second.week == 2 and second.budget_s == 12 * HOUR
    assert third.budget_s == pytest.approx(10 * HOUR)  # 30 - 8 - 12 left in week 2
    assert plan.sessions[3].waited_for_quota and plan.sessions[3].starts == SATURDAY + timedelta(days=7)
    assert all(v <= q.total_allowed_s + 1e-6 for v in billed_per_week(plan, q).values())


def test_invariants_on_random_inputs():
    rng = random.Random(4)
    for _ in range(200):
        now = TUESDAY + timedelta(minutes=rng.randrange(0, 14 * 24 * 60))
        q = quota(rng.uniform(0, 30), now=now, refresh=next_weekly_reset(now))
        limits = SessionLimits(session_cap_s=rng.choice([2, 9, 12]) * HOUR, min_train_s=rng.choice([0, 1800, 7200]))
        steps, step_s = rng.randrange(1, 60_000), rng.uniform(0.5, 60)
        plan = plan_sessions(steps, step_s, q, now, limits=limits)
        assert sum(s.steps for s in plan.sessions) == steps
        assert all(s.steps >= 1 and s.budget_s <= limits.session_cap_s + 1e-6 for s in plan.sessions)
        assert all(a.ends <= b.starts for a, b in zip(plan.sessions, plan.sessions[1:]))
        assert plan.sessions[0].starts >= now
        weeks = billed_per_week(plan, q)
        assert weeks.get(1, 0) <= q.remaining_s + 1e-6
        assert all(v <= q.total_allowed_s + 1e-6 for v in weeks.values())


def test_concurrency_runs_independent_sessions_side_by_side():
    plan = plan_sessions(16_000, 10.0, quota(30), TUESDAY, limits=SessionLimits(concurrency=2))
    assert plan.sessions[0].starts == plan.sessions[1].starts == TUESDAY
    # Two 12 h sessions leave 6 h of this week: the next one gets them, the one beside it waits.
    assert plan.sessions[2].budget_s == 6 * HOUR and not plan.sessions[2].waited_for_quota
    assert plan.sessions[3].waited_for_quota and plan.sessions[3].starts == SATURDAY
    assert sum(s.steps for s in plan.sessions) == 16_000


def test_not_before_delays_the_first_session():
    later = TUESDAY + timedelta(hours=5)
    plan = plan_sessions(100, 1.0, quota(30), TUESDAY, not_before=later)
    assert plan.sessions[0].starts == later and plan.state == "ready"


def test_zero_remaining_work_is_done():
    plan = plan_sessions(0, 10.0, quota(0), TUESDAY)
    assert plan.done and plan.state == "done" and plan.sessions == () and plan.finish is None
    assert format_plan(plan).startswith("done: no training steps left")


def test_format_plan_has_the_columns_finish_and_quota_line():
    text = format_plan(plan_sessions(10_000, 10.0, quota(20), TUESDAY, steps_per_epoch=3000))
    header = text.splitlines()[0].split()
    assert header == ["session", "starts", "budget", "steps", "GPU", "so", "far", "week"]
    # 12 h + the 8 h left this week, then the rest waits for Saturday's refresh.
    assert "12h00m" in text and " 8h00m" in text and "(quota wait)" in text
    assert "finish Sat 2026-11-28 08:31 UTC" in text and "ep 1.41)" in text
    assert "quota: 20h00m of 30h00m GPU left this week" in text and "refreshes Sat 2026-11-28 00:00 UTC" in text
    assert "(Kaggle's quota statistics)" in text  # where the refresh time comes from, said beside it
    from_ledger = format_plan(plan_sessions(10_000, 10.0, quota_from_ledger([], TUESDAY), TUESDAY))
    assert "(assumed: Kaggle's weekly reset, Saturday 00:00 UTC; the quota statistics were not read)" in from_ledger


@pytest.mark.parametrize("kwargs, field", [
    ({"step_seconds": 13 * HOUR}, "step_seconds"),
    ({"step_seconds": 0}, "step_seconds"),
    ({"step_seconds": float("nan")}, "step_seconds"),
    ({"remaining_steps": -1}, "remaining_steps"),
    ({"remaining_steps": 2.5}, "remaining_steps"),
    ({"limits": SessionLimits(session_cap_s=600)}, "limits.session_cap_s"),
    ({"limits": SessionLimits(concurrency=0)}, "limits.concurrency"),
    ({"limits": SessionLimits(startup_s=-1)}, "limits.startup_s"),
    ({"now": datetime(2026, 11, 24, 9)}, "now"),
    ({"steps_per_epoch": 0}, "steps_per_epoch"),
])
def test_bad_inputs_raise_one_line_errors_naming_the_field(kwargs, field):
    args = {"remaining_steps": 1000, "step_seconds": 10.0, "quota": quota(30), "now": TUESDAY, **kwargs}
    with pytest.raises(PlanError) as err:
        plan_sessions(args.pop("remaining_steps"), args.pop("step_seconds"), args.pop("quota"), args.pop("now"), **args)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_quota_too_small_for_one_session_is_an_error():
    with pytest.raises(PlanError, match="quota.total_allowed_s"):
        plan_sessions(10, 10.0, quota(0, total_h=0.1), TUESDAY)


def test_weekly_reset_rule():
    assert last_weekly_reset(TUESDAY) == SATURDAY - timedelta(days=7)
    assert next_weekly_reset(TUESDAY) == SATURDAY
    assert last_weekly_reset(SATURDAY) == SATURDAY  # a reset instant belongs to the new week
    assert next_weekly_reset(SATURDAY - timedelta(seconds=1)) == SATURDAY
    assert next_weekly_reset(TUESDAY, weekday=0, hour=6) == datetime(2026, 11, 30, 6, tzinfo=UTC)


def test_quota_from_ledger_counts_only_this_weeks_billed_time():
    friday = SATURDAY + timedelta(days=6)
    ledger = [
        (SATURDAY - timedelta(days=3), 12 * HOUR),                 # last week: ignored
        (SATURDAY - timedelta(hours=2), 10 * HOUR),                # straddles the reset: 8 h count
        {"started": (SATURDAY + timedelta(days=1)).timestamp(), "seconds": 11 * HOUR},
        (friday + timedelta(hours=5), 1 * HOUR),                   # after `now`: not yet billed
    ]
    q = quota_from_ledger(ledger, friday)
    assert q.source == "ledger" and q.used_s == pytest.approx(19 * HOUR)
    assert q.remaining_s == pytest.approx(11 * HOUR)
    assert q.refresh_at == SATURDAY + timedelta(days=7)
    plan = plan_sessions(10_000, 10.0, q, friday)
    assert plan.sessions[0].budget_s == pytest.approx(11 * HOUR)  # all the quota left this week


def test_quota_from_ledger_rejects_bad_records():
    with pytest.raises(PlanError, match=r"ledger\[0\].billed_s"):
        quota_from_ledger([(TUESDAY, -5)], TUESDAY)
    with pytest.raises(PlanError, match=r"ledger\[0\].start"):
        quota_from_ledger([("yesterday", 5)], TUESDAY)


def test_quota_from_api_wire_dict_and_sdk_object():
    wire = {"quotaRefreshTime": "2026-11-28T00:00:00Z",
            "gpuQuota": {"timeUsed": "36000s", "timeReserved": "3600s", "totalTimeAllowed": "108000s"}}
    q = quota_from_api(wire, TUESDAY)
    assert (q.total_allowed_s, q.used_s, q.reserved_s, q.refresh_at) == (108000, 36000, 3600, SATURDAY)
    assert q.remaining_s == 68400
    sdk = SimpleNamespace(quota_refresh_time=SATURDAY, gpu_quota=SimpleNamespace(
        time_used=timedelta(hours=10), time_reserved=None, total_time_allowed=timedelta(hours=30)))
    assert quota_from_api(sdk, TUESDAY).remaining_s == 20 * HOUR
    stale = dict(wire, quotaRefreshTime="2026-11-21T00:00:00Z")
    assert quota_from_api(stale, TUESDAY).refresh_at == SATURDAY
    with pytest.raises(PlanError, match="gpuQuota"):
        quota_from_api({}, TUESDAY)
    with pytest.raises(PlanError, match="gpuQuota.timeUsed"):
        quota_from_api({"gpuQuota": {"timeUsed": "lots", "totalTimeAllowed": "1s"}}, TUESDAY)


def test_plan_from_progress_uses_measured_step_time():
    sessions = [{"step_start": 0, "step_end": 1000, "seconds": 10_300, "save_seconds": 300},
                {"step_start": 1000, "step_end": 1000, "seconds": 50}]  # no progress: ignored
    assert measured_step_seconds(sessions) == pytest.approx(10.0)
    assert measured_step_seconds([]) is None
    plan = plan_from_progress({"total_steps": 5000, "global_step": 1000, "sessions": sessions},
                              quota(30), TUESDAY, step_seconds_estimate=99.0)
    assert plan.step_seconds == pytest.approx(10.0) and plan.sessions[0].step_start == 1000
    assert plan.remaining_steps == 4000
    fresh = plan_from_progress({}, quota(30), TUESDAY, step_seconds_estimate=2.0, total_steps=100)
    assert fresh.remaining_steps == 100 and fresh.step_seconds == 2.0
    with pytest.raises(PlanError, match="^total_steps"):
        plan_from_progress({}, quota(30), TUESDAY, step_seconds_estimate=2.0)
    with pytest.raises(PlanError, match="^step_seconds_estimate"):
        plan_from_progress({"total_steps": 10}, quota(30), TUESDAY)


def test_leftover_quota_below_min_train_waits_but_a_fresh_week_never_does():
    # 40 min left buys 25 min of training < min_train_s (30 min): wait for the refresh.
    plan = plan_sessions(10_000, 10.0, quota(40 / 60), TUESDAY)
    assert plan.state == "waiting" and plan.sessions[0].budget_s == 12 * HOUR
    # A weekly quota smaller than min_train_s + overhead still makes progress every week.
    tiny = SessionLimits(min_train_s=10 * HOUR)
    plan = plan_sessions(10_000, 10.0, quota(2, total_h=2), TUESDAY, limits=tiny)
    assert plan.state == "ready" and all(s.budget_s <= 2 * HOUR for s in plan.sessions)
    assert sum(s.steps for s in plan.sessions) == 10_000


def test_vqa_t4_spec_plan_caps_sessions_at_session_budget():
    """The VQA example of docs/recipes.md: 100 epochs of 11k questions at 1.72 s a step, started on a Monday with a full
    quota. session.budget 11h30m (below Kaggle's 12 h) caps every session's training at 11h25m."""
    from relay.orchestrator.plan import limits_from_spec
    from relay.shared import spec as spec_mod

    spec = spec_mod.load(REPO / "examples" / "vqa-t4.yaml")
    limits = limits_from_spec(spec)
    assert limits.max_train_s == spec.session.budget - spec.session.safety_margin == 11 * HOUR + 25 * 60
    monday = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
    total = spec.optim.epochs * (11000 // (spec.optim.micro_batch * spec.optim.grad_accum))
    plan = plan_from_progress({}, quota_from_ledger([], monday, total_allowed_s=spec.kaggle.weekly_gpu_quota),
                              monday, limits=limits, step_seconds_estimate=1.72, total_steps=total)
    assert total == 122200 and len(plan.sessions) == 6 and [s.week for s in plan.sessions] == [1, 1, 1, 2, 2, 2]
    assert max(s.train_s for s in plan.sessions) == 11 * HOUR + 25 * 60  # not 11h45m
    assert plan.finish.strftime("%a") == "Sun" and plan.sessions[-1].starts < monday + timedelta(days=7)


def test_session_max_steps_caps_each_planned_session():
    """session.max_steps ends a session after that many steps whatever time is left: the plan counts them."""
    from relay.orchestrator.plan import SessionLimits, plan_sessions, quota_from_ledger

    now = datetime(2026, 11, 23, 12, tzinfo=timezone.utc)
    plan = plan_sessions(300, 0.01, quota_from_ledger([], now), now, limits=SessionLimits(max_steps=100))
    assert [s.steps for s in plan.sessions] == [100, 100, 100]
    assert all(s.budget_s == pytest.approx(SessionLimits().startup_s + SessionLimits().save_s + 1.0)
               for s in plan.sessions)
