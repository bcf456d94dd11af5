"""The `relays` parent flow on the emulator: three toy relays (different seeds) and one bad spec, a cap of 2
concurrent GPU sessions (the emulator's max_gpu_sessions, enforced by refusing a third push), and a quota that
runs out mid-way. Ticks until the first handoff, then the test spends the quota (event: a relay was handed
over; the emulator's gpu_quota_s is lowered below what is used), ticks until every relay waits for the same
refresh, gives the quota back and lets `watch` finish. All three end with the weights of their uninterrupted
runs, never more than 2 sessions ran at once (the emulator's kernel start/end times), no push was refused."""
from __future__ import annotations

import json
import time

import pytest

from relay_fixtures import STEPS_PER_SESSION, USER, write_spec  # noqa: E402

NAMES = ("toy-fold-a", "toy-fold-b", "toy-fold-c")
MAX_STEPS = 2 * STEPS_PER_SESSION


def _max_overlap(emu) -> int:
    """The most kernel versions (any relay) whose [started, ended] intervals overlap at one instant."""
    events = []
    with emu.store.lock:
        for kernel in emu.store.kernels.values():
            for v in kernel["versions"]:
                if v.get("started"):
                    events += [(v["started"], 1), (v.get("ended") or float("inf"), -1)]
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        running += delta
        peak = max(peak, running)
    return peak


def _published(emu, name: str) -> dict:
    ref = f"{USER}/{name}-ckpt"
    with emu.store.lock:
        number = emu.store.datasets[ref]["versions"][-1]["number"]
    return json.loads((emu.store.dataset_dir(ref, number) / "progress.json").read_text())


def test_three_relays_share_the_cap_and_one_quota_wait(relay_env, reference, monkeypatch, tmp_path):
    import flows.relays_sharing_quota as relays_sharing_quota
    import tasks.relay_host as relay_host
    from flows.one_relay import RelayFailed

    emu = relay_env.start()
    assert emu.config.max_gpu_sessions == 2
    specs = [write_spec(tmp_path / name, **{"name": name, "seed": 3 + i, "optim.max_steps": MAX_STEPS})
             for i, name in enumerate(NAMES)]
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: toy-broken\nrecipe: toy\noptim: {max_steps: -1}\n")
    for spec in specs:
        reference.start(spec)
    monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: relay_env.backend())
    args = dict(specs=[str(s) for s in specs] + [str(broken)], cap=2, poll_seconds=0.3,
                state_dir=str(tmp_path / "orchestrator"))
    allowed = emu.config.gpu_quota_s

    ticks, spent_at = [], None
    for _ in range(300):
        res = relays_sharing_quota.relays(mode="tick", **args)
        ticks.append(res)
        assert res["relays"]["broken"]["state"] == "failed" and "bad spec" in res["relays"]["broken"]["error"]
        assert res["refused"] == 0, res
        if spent_at is None and res["handed_over"]:
            spent_at = len(ticks)
            emu.config.gpu_quota_s = 1e-3  # spent: every account's use is above it
        elif spent_at is not None and res["state"] == "waiting":
            break
        if not res["pushed"] and not res["handed_over"]:
            time.sleep(0.3)
    assert spent_at is not None and res["state"] == "waiting", ticks[-3:]
    # once a session was measured, the joint plan gives an ETA for all (the quota was still whole then)
    assert ticks[spent_at - 1]["eta_all"] is not None, ticks[spent_at - 1]
    # after the quota ran out: sessions in flight were still handed over, nothing was pushed
    assert all(not r["pushed"] for r in ticks[spent_at:]), [r["pushed"] for r in ticks]
    # one wait for all: every unfinished relay waits for the same refresh
    waiting = {n: r["state"] for n, r in res["relays"].items() if n != "broken"}
    assert res["quota_wait"] and set(waiting.values()) <= {"waiting for quota", "done"}, res
    assert "waiting for quota" in waiting.values()
    assert relays_sharing_quota.relays(mode="tick", **args)["pushed"] == []  # idempotent while waiting

    emu.config.gpu_quota_s = allowed  # the refresh
    with pytest.raises(RelayFailed) as failed:  # watch ends when all are done, then reports the bad spec
        relays_sharing_quota.relays(mode="watch", **args)
    assert "broken: bad spec" in str(failed.value) and "toy-fold" not in str(failed.value)

    for name, spec in zip(NAMES, specs):
        progress = _published(emu, name)
        assert progress["status"] == "done" and progress["global_step"] == MAX_STEPS, (name, progress)
        assert progress["weights_sha256"] == reference.weights(spec), name
    assert _max_overlap(emu) <= 2
    assert (tmp_path / "orchestrator" / "relays-timeline.png").is_file()
