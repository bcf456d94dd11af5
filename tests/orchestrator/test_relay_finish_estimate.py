"""The finish estimate of a real relay (issue 47): 4 sessions bounded by steps on the emulator, under the relay flow
and a Prefect server. From its second session on, what the relay's surfaces say (policy.forecast, as `relay
status`, the progress artifact and the summary call it: tests/orchestrator/test_finish_estimate.py) is close to the remaining
time to the real finish, once the relay measured its own start-up, save and hand-over. The issue's bar is 20 %: met
in every run here (misses 0.02-0.13 of the remaining time), but an emulator hand-over on a loaded 2-core machine
took 1.3-7.7 s, so the test allows 50 %; what it guards (the relay's own figures in place of the spec's 2-min
start-up and a default hand-over) moves the miss 30-40x, far past either bound. Each estimate is
the one the relay could make at an event: the first quarter of a session's steps, from the records published
before it and that session's own progress lines (read back from Kaggle's stored log), not a moment slept to."""
from __future__ import annotations

from datetime import datetime, timezone

from byo_fixtures import tiny_session_script
from kaggle_fixtures import KERNEL_ENV

NAME = "finish-relay"
STEPS, PER_SESSION = 64, 16
# each step sleeps: the sessions' training, not the machine's load, is most of the run's time
SCRIPT = tiny_session_script(head="import time", lr=0.01, loss="model(torch.randn(8, 4)).pow(2).mean()",
                             report_loss=True, before_step="time.sleep(0.7)")  # a loss: a progress line a step


def test_the_finish_estimate_from_the_second_session_on_is_close_to_the_real_finish(relay_env, monkeypatch):
    from relay.orchestrator import live_progress as live, policy
    from relay.shared import spec as spec_mod
    from relay.shared.progress_line import parse

    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_PROGRESS_EVERY": "0"})  # a progress line every step
    # kaggle.startup_overhead left at its default (2 min): sessions start in seconds here, as the issue measured
    flow, result = relay_env.flow_thread(monkeypatch, "finish", SCRIPT, {
        "name": NAME, "optim": {"max_steps": STEPS, "log_every_steps": 1},
        "session": {"threads": 1, "max_steps": PER_SESSION, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "10m"}}, poll_seconds=0.2, live_seconds=1.0)
    flow.join(300)  # a hang guard
    assert result.get("state") == "done" and result.get("step") == STEPS, result

    final = relay_env.published_progress()
    sessions, charges = final["sessions"], final["charges"]
    assert [s["step_end"] for s in sessions] == [16, 32, 48, 64] and len(charges) == 4, final
    finish = float(sessions[-1]["ended"])
    spec = spec_mod.load(relay_env.spec)
    backend = relay_env.backend()
    versions = {r.run_id: r.version for r in relay_env.kernel_runs()}

    misses, sources = {}, {}
    for k in range(2, 5):
        before = sessions[:k - 1]
        known = {"run_id": before[-1]["run_id"], "global_step": before[-1]["step_end"], "total_steps": STEPS,
                 "sessions": before, "charges": [c for c in charges if c["run_id"] in {s["run_id"] for s in before}]}
        run_id = sessions[k - 1]["run_id"]
        log = "".join(str(e.get("data", "")) for e in backend.version_log(relay_env.kernel, versions[run_id]))
        lines = [parse(line) for line in log.splitlines()]
        records = [r for r in lines if r and r.get("run_id") == run_id and r.get("kind") == "train"]
        upto = [r for r in records if r["step"] <= sessions[k - 1]["step_start"] + PER_SESSION // 4]
        eta = live.estimate(upto, PER_SESSION)
        assert eta is not None, upto
        at = datetime.fromtimestamp(eta.as_of, timezone.utc)
        said = policy.forecast(spec, known, None, at, running=eta)
        assert said.finish is not None, said.text
        misses[k] = round(abs(said.finish.timestamp() - finish) / (finish - eta.as_of), 3)
        sources[k] = (said.figures.startup.source, said.figures.handover.source)
    print("finish estimate misses (of the remaining time):", misses)
    assert all(miss <= 0.5 for miss in misses.values()), (misses, said.text)
    # the spec's 2 min start-up and the default hand-over were replaced by the relay's own figures
    assert all("measured over" in a and "measured over" in b for a, b in sources.values()), sources
