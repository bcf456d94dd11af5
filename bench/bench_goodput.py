"""The goodput ledger (relay/orchestrator/goodput.py, issue 47) of a clean and a faulted relay, against the
emulator's own quota ledger.

    python bench/bench_goodput.py [--keep] [--charts DIR]   # prints both ledgers (and draws them into DIR)

The same toy relay (relay/kernel/recipes/toy.py, one CPU thread: 600 optimizer steps in sessions of 150,
`session.max_steps`, so the work is a count of steps on any machine) is run to its end twice, one after the other,
each on an emulator of its own, by the `relay` flow itself (flows/one_relay.py, in this process, on a Prefect test
harness; the backend with the tests' fast retry policy, as tests/relay_fixtures.py run_flow does):

- clean: no faults: the baseline;
- faulted, every fault set by an event or a count, none by a timer:
  - a kill mid-run: every kernel has RELAY_TEST_STOP_MID_SAVE=270 (the tests' seam, relay/kernel/session/
    checkpoint.py): the session that trains through step 270 (session 2: steps 150-300) stops itself inside
    its first save at or past it, and a watcher here SIGKILLs it there (relay/emulator/mid_save_kill.py, as the
    tests do). The relay salvages its last committed checkpoint; the steps after it are trained again;
  - a wedge: the emulator's `wedge` fault on its 3rd batch run (the session after the salvage): its process ends
    but Kaggle reports it running, without output, until its kernel is deleted. The relay finds it running past
    its deadline (its push + the timeout it asked, session.budget 30 s + margins, + startup_overhead), deletes
    the kernel and pushes the session again from the last published checkpoint (kaggle.on_wedged: delete);
  - error pages and dropped requests: 10 % of the backend's calls (every RPC and output download) answer 429,
    500, an HTML error page (503), a reset connection, or are handled and their answer lost (seeded per call).

For each relay: the ledger as the relay published it (goodput.from_progress of the checkpoint dataset's
progress.json, what `relay status` and the summary artifact show), its line and table; the emulator's quota ledger
for the relay's kernels (the deleted one included), and the difference. The published ledger charges each attempt
from its push (the queue is counted, the safe side) to what the relay saw of its end (the `end` line of its
process; a wedged one its deadline), so it differs from Kaggle's charge by the queue and the shut-down. Then the
same ledger with Kaggle's start and end for each attempt (the emulator's quota ledger, `kaggle_start` /
`kaggle_end`, as tests/orchestrator/test_goodput.py does): its categories must add up to what the emulator charged within
TOLERANCE_S, and every charged kernel version must be one of the ledger's attempts. Finally, both relays must end
with the same weights (exact resume through the faults).

What the published ledger cannot see (measured here, not a target): a clean hand-over's charge ends at its
process's `end` line, so Kaggle's shut-down after it is not in it (the `shut-down` column is empty there); the
killed session's charge (salvaged: no `end` line, not wedged) has neither its process's end nor when the relay saw
it end, so the ledger ends it at its last save and the time after it (the steps trained again, the torn save) is
missing from it; with Kaggle's end it is `training redone`.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER, KEY = "bench", "bench-goodput-key-0123456789"
TOLERANCE_S = 0.01      # the categories vs the emulator's charge, all attempts together (float rounding only)
STOP_MID_SAVE_AT = 270  # inside session 2 (steps 150-300)
WEDGED_PUSH = 3         # the emulator's 3rd batch run: the session after the salvaged one
FAULTS = {"seed": 47, "methods": {"*": {"rate": 0.10, "kinds": ["429", "500", "html", "reset", "lost"]}},
          "wedge": {"pushes": [WEDGED_PUSH]}}

SPEC = {
    "recipe": "toy",
    "seed": 3,
    # ~19 ms a step on one thread here (32 micro-batches of 32 a step): a session trains ~3 s, long enough for
    # ~10 periodic saves (session.save_every 0.3 s), so the kill mid-save in session 2 always has saves before it
    "params": {"n_train": 4096, "n_eval": 64, "hidden": 256},
    "optim": {"micro_batch": 32, "grad_accum": 32, "lr": 0.003, "max_steps": 600, "warmup_steps": 5,
              "log_every_steps": 10, "eval_every_steps": 100},
    "data": {"num_workers": 0},
    # max_steps ends the sessions; the budget is a backstop that also sets a wedged session's deadline
    "session": {"threads": 1, "max_steps": 150, "budget": "30s", "save_every": "0.3s", "safety_margin": "0.5s"},
    "checkpoints": {"keep_last": 2},
    "kaggle": {"session_timeout": "5m", "startup_overhead": "1s", "max_failed_sessions": 2, "lease": "10s"},
}
KERNEL_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RELAY_DEVICE": "cpu"}


# -- one relay ----------------------------------------------------------------------------------------------------
def _backend(emu):
    from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy

    policy = RetryPolicy(attempts=14, base_delay_s=0.01, multiplier=2.0, max_delay_s=0.2, rng=random.Random(0))
    return ClientBackend(KaggleCredentials(USER, key=KEY), emu.url, policy, dataset_poll_s=0.1, dataset_wait_s=120)


def relay_once(work: Path, name: str, faulted: bool) -> dict:
    """The `relay` flow to the end of the toy relay `name` on an emulator of its own; what it left (see measure)."""
    import yaml

    import tasks.relay_host as relay_host
    from flows.one_relay import relay
    from relay.emulator import Emulator, EmulatorConfig
    from relay.emulator.mid_save_kill import MidSaveKiller
    from relay.orchestrator.kaggle.kernel_source import find_run_id

    spec_path = work / name / "spec.yaml"
    spec_path.parent.mkdir(parents=True)
    spec_path.write_text(yaml.safe_dump({"name": name, **SPEC}, sort_keys=False))
    env = dict(KERNEL_ENV, **({"RELAY_TEST_STOP_MID_SAVE": str(STOP_MID_SAVE_AT)} if faulted else {}))
    emu = Emulator(work / name / "emulator", EmulatorConfig(
        users={USER: KEY}, kernel_env=env, sigterm_grace=2.0, retry_after="0",
        faults=json.loads(json.dumps(FAULTS)) if faulted else None)).start()
    kernel = f"{USER}/{name}-session"
    killer = MidSaveKiller(emu, kernel, run_id_of=find_run_id) if faulted else None
    saved = relay_host.make_backend
    relay_host.make_backend = lambda credentials_block=None: _backend(emu)
    t0 = time.time()
    try:
        if killer:
            killer.start()
        summary = relay(spec=str(spec_path), mode="watch", poll_seconds=0.5, state_dir=str(work / name / "orch"),
                        step_lock_wait_s=0)
        wall = time.time() - t0
    finally:
        relay_host.make_backend = saved
        if killer:
            killer.done.set()
            killer.join(5)
        emu.stop()
    if killer and killer.error:
        raise killer.error
    if summary.get("state") != "done":
        raise RuntimeError(f"{name}: the relay ended {summary}")
    out = measure(emu, name, kernel)
    out.update(wall_s=wall, summary=summary, killed=killer.killed if killer else None,
               injected=dict(emu.faults.injected) if faulted else {},
               calls=sum(emu.faults._counts.values()) if faulted else 0)
    return out


def _versions(emu, kernel: str) -> list:
    """Every version the relay's kernel ran, the deleted kernel's too: (number, started, run id)."""
    from relay.orchestrator.kaggle.kernel_source import find_run_id

    out = []
    with emu.store.lock:
        deleted = [k for k in emu.store.data.get("deleted_kernels") or [] if k["ref"] == kernel]
        current = json.loads(json.dumps(emu.store.kernels.get(kernel) or {"versions": []}))
    for k in deleted:
        gone = emu.store.root / "deleted" / kernel / str(k["id"])
        out += [(v["number"], v.get("started"), find_run_id((gone / f"v{v['number']}" / "source.py").read_text()))
                for v in k["versions"]]
    out += [(v["number"], v.get("started"), find_run_id((emu.store.kernel_dir(kernel, v["number"]) / "source.py")
                                                        .read_text())) for v in current["versions"]]
    return out


def measure(emu, name: str, kernel: str) -> dict:
    """The published ledger, the emulator's quota ledger for `kernel`, and the ledger with Kaggle's start and end."""
    from relay.orchestrator import goodput
    from relay.shared import spec as spec_mod

    ckpt = f"{USER}/{name}-ckpt"
    with emu.store.lock:
        newest = emu.store.datasets[ckpt]["versions"][-1]["number"]
        quota = [dict(e) for e in emu.store.data["quota"] if e["kernel"] == kernel]
    progress = json.loads((emu.store.dataset_dir(ckpt, newest) / "progress.json").read_text())
    save_every = spec_mod.load(emu.store.root.parent / "spec.yaml").session.save_every
    published = goodput.from_progress(progress, save_every)
    versions = _versions(emu, kernel)
    by_run = {}
    for e in quota:  # each charged run: its version of this kernel (or of the deleted one), by number and start
        run = next(r for n, started, r in versions if n == e["version"] and started == e["start"])
        by_run[run] = e
    exact_charges = [dict(c, kaggle_start=by_run[c["run_id"]]["start"], kaggle_end=by_run[c["run_id"]]["end"])
                     if c["run_id"] in by_run else dict(c) for c in progress.get("charges") or []]
    exact = goodput.ledger(progress["sessions"], exact_charges, save_every)
    return {"progress": progress, "published": published, "exact": exact, "quota": quota, "by_run": by_run,
            "emulator_s": sum(e["kaggle_seconds"] for e in quota),
            "unlisted": sorted(set(by_run) - {a.run_id for a in exact.attempts}), "versions": versions}


# -- the bench ----------------------------------------------------------------------------------------------------
def _figures(prefix: str, r: dict) -> dict:
    pub, exact = r["published"], r["exact"]
    f = {f"{prefix}_sessions_handed_over": len(r["progress"]["sessions"]), f"{prefix}_attempts": len(exact.attempts),
         f"{prefix}_kernel_runs_charged": len(r["quota"]), f"{prefix}_steps": r["progress"]["global_step"],
         f"{prefix}_wall_s": round(r["wall_s"], 1),
         f"{prefix}_emulator_charged_s": round(r["emulator_s"], 3),
         f"{prefix}_published_charged_s": round(pub.charged_s, 3),
         f"{prefix}_published_minus_emulator_s": round(pub.charged_s - r["emulator_s"], 3),
         f"{prefix}_published_shut_down_s": round(pub.totals["shut-down"], 3),
         f"{prefix}_published_goodput": round(pub.goodput or 0.0, 4),
         f"{prefix}_exact_sum_s": round(sum(exact.totals.values()), 6),
         f"{prefix}_exact_minus_emulator_s": round(sum(exact.totals.values()) - r["emulator_s"], 6),
         f"{prefix}_goodput": round(exact.goodput or 0.0, 4),
         f"{prefix}_unlisted_runs": r["unlisted"],
         f"{prefix}_weights_sha256": r["progress"].get("weights_sha256")}
    for c, s in exact.totals.items():
        f[f"{prefix}_{c.replace(' ', '_').replace('-', '_')}_s"] = round(s, 3)
    return f


def run(keep: bool = False, charts: Path | None = None) -> dict:
    """The clean and the faulted relay; returns flat figures (goodput_clean_*, goodput_faulted_*, goodput_*).
    `charts`: a folder for both published ledgers drawn (goodput-clean.png, goodput-faulted.png)."""
    sys.path.insert(0, str(ROOT))
    from prefect.testing.utilities import prefect_test_harness

    from sandbox import environment, temporary_files_in, work_folder  # bench/sandbox.py

    with work_folder("bench-goodput-", keep, ("home", "tmp", "prefect")) as work, environment(
            HOME=str(work / "home"), PREFECT_HOME=str(work / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
            DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW="ignore"):
        # the harness's database in the system's temporary folder (it removes it at exit); then the kaggle
        # client's upload state in ours
        with prefect_test_harness(server_startup_timeout=300):
            temporary_files_in(work / "tmp")
            clean = relay_once(work, "goodput-clean", faulted=False)
            faulted = relay_once(work, "goodput-faulted", faulted=True)

    figures = {"goodput_tolerance_s": TOLERANCE_S, **_figures("goodput_clean", clean),
               **_figures("goodput_faulted", faulted)}
    inj = faulted["injected"]
    error_pages = sum(inj.get(k, 0) for k in ("429", "500", "html", "reset", "lost"))
    wedged = [c for c in faulted["progress"].get("charges") or [] if c.get("wedged")]
    killed = faulted["killed"] or {}
    # the kill: steps trained after the salvaged checkpoint, up to the save it was killed in (trained again)
    salvaged = next((s["step_end"] for s in faulted["progress"]["sessions"] if s["run_id"] == killed.get("run_id")),
                    None)
    torn_step = int(killed["torn"][len(".tmp-step-"):].split("-")[0]) if killed else None
    lost_steps = torn_step - int(salvaged) if killed and salvaged is not None else 0
    figures.update({
        "goodput_faulted_killed_run": killed.get("run_id"), "goodput_faulted_killed_in_save_of_step": torn_step,
        "goodput_faulted_salvaged_step": salvaged, "goodput_faulted_steps_trained_again": lost_steps,
        "goodput_faulted_wedged_runs": [c["run_id"] for c in wedged],
        "goodput_faulted_injected": inj, "goodput_faulted_backend_calls": faulted["calls"],
        "goodput_faulted_error_pages": error_pages,
        "goodput_same_weights": clean["progress"].get("weights_sha256") == faulted["progress"].get("weights_sha256"),
        "goodput_clean_line": clean["published"].line(), "goodput_faulted_line": faulted["published"].line(),
        "goodput_clean_table": clean["exact"].table(), "goodput_faulted_table": faulted["exact"].table(),
        "goodput_clean_published_table": clean["published"].table(),
        "goodput_faulted_published_table": faulted["published"].table(),
        "goodput_clean_per_run": _per_run(clean), "goodput_faulted_per_run": _per_run(faulted),
    })
    if charts is not None:  # the ledgers as `relay status` and the summary artifact draw them
        from relay.orchestrator.goodput_chart import plot_goodput

        for label, r in (("clean", clean), ("faulted", faulted)):
            figures[f"goodput_{label}_chart"] = str(plot_goodput(r["published"], Path(charts) / f"goodput-{label}.png"))
    figures["goodput_meets_target"] = bool(
        all(abs(figures[f"goodput_{p}_exact_minus_emulator_s"]) <= TOLERANCE_S
            and not figures[f"goodput_{p}_unlisted_runs"] for p in ("clean", "faulted"))
        and faulted["killed"] is not None and wedged and error_pages > 0 and figures["goodput_same_weights"]
        and lost_steps > 0 and figures["goodput_faulted_training_redone_s"] > 0
        and figures["goodput_faulted_failed_attempt_s"] > 0)
    return figures


def _per_run(r: dict) -> list:
    """Per charged run: (run id, emulator's charge, the published ledger's charge) in seconds."""
    pub = {a.run_id: a.charged_s for a in r["published"].attempts}
    return [(run, round(e["kaggle_seconds"], 2), round(pub.get(run, 0.0), 2))
            for run, e in sorted(r["by_run"].items(), key=lambda kv: kv[1]["start"])]


def format_lines(f: dict) -> list:
    lines = ["goodput ledger vs the emulator's quota ledger, toy relay of 600 steps in sessions of 150 "
             f"(both relays in one run; tolerance {f['goodput_tolerance_s']} s):"]
    for p, title in (("clean", "clean"), ("faulted", "faulted")):
        k = f"goodput_{p}"
        lines += [f"  {title}: {f[k + '_line']}",
                  f"    emulator charged {f[k + '_emulator_charged_s']:.2f} s over"
                  f" {f[k + '_kernel_runs_charged']} kernel run(s); published ledger"
                  f" {f[k + '_published_charged_s']:.2f} s (diff {f[k + '_published_minus_emulator_s']:+.2f} s: it"
                  f" counts the queue, not the shut-down nor a killed session's time after its last save);"
                  f" with Kaggle's start/end {f[k + '_exact_sum_s']:.3f} s (diff"
                  f" {f[k + '_exact_minus_emulator_s']:+.6f} s)"
                  f"  {'OK' if abs(f[k + '_exact_minus_emulator_s']) <= f['goodput_tolerance_s'] else 'MISSED'}",
                  f"    goodput with Kaggle's start/end {f[k + '_goodput']:.1%}; {f[k + '_steps']} steps in"
                  f" {f[k + '_sessions_handed_over']} hand-overs, {f[k + '_attempts']} attempts; unlisted runs:"
                  f" {f[k + '_unlisted_runs'] or 'none'}; wall {f[k + '_wall_s']:.0f} s",
                  "    per run (emulator s / published s): " + ", ".join(
                      f"{run.rsplit('-', 2)[-2]}-{run.rsplit('-', 1)[-1]} {e:.1f}/{p_:.1f}"
                      for run, e, p_ in f[k + "_per_run"])]
        lines += ["    " + row for row in f[k + "_table"].splitlines()]
    lines.append(f"  faults: {f['goodput_faulted_killed_run']} killed in its save of step"
                 f" {f['goodput_faulted_killed_in_save_of_step']}, salvaged at step"
                 f" {f['goodput_faulted_salvaged_step']}"
                 f" ({f['goodput_faulted_steps_trained_again']} steps trained again); wedged and deleted"
                 f" {f['goodput_faulted_wedged_runs']}; {f['goodput_faulted_error_pages']} error pages/dropped of"
                 f" {f['goodput_faulted_backend_calls']} backend calls {f['goodput_faulted_injected']}")
    lines.append(f"  same final weights clean vs faulted: {f['goodput_same_weights']}"
                 f"  {'OK' if f['goodput_meets_target'] else 'MISSED'}")
    return lines


if __name__ == "__main__":
    charts = sys.argv[sys.argv.index("--charts") + 1] if "--charts" in sys.argv else None
    figures = run(keep="--keep" in sys.argv, charts=Path(charts) if charts else None)
    print("\n".join(format_lines(figures)))
    if "--json" in sys.argv:
        print(json.dumps(figures, indent=1))
