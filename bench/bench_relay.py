"""Quota efficiency of a relay on the local Kaggle emulator, next to the seeds' checkpoint policy.

    python bench/bench_relay.py            # prints both policies side by side; run() returns the figures

The same toy workload (relay/kernel/recipes/toy.py, one CPU thread) is trained to the end twice, as kernels of the
emulator with the same session cap (`session_s` wall seconds, time scale 1):

- relay: the relay's own loop (relay.orchestrator.chain.decide + relay.orchestrator.handoff: push, wait, hand over; the `relay` flow
  minus Prefect). Each kernel runs `relay train` with the budget the flow would give it (session cap minus the
  spec's kaggle.startup_overhead); it stops itself before the cap, saves once and exits; the next session
  resumes from that exact step.
- seeds: the policy of the seed notebooks: checkpoint every `every_epochs` epochs, no budget, killed by the
  session cap (SIGTERM, no handler), the next session resumes from the last epoch checkpoint; whatever was
  trained since is lost. Same runtime, same model and data, only the save policy and the stop differ.

Per session, from the kernels' progress.json (sessions), metrics.jsonl (a timestamp per optimizer step) and
the emulator's kernel start/end times (billed GPU time):
  start-up       kernel start -> session clock start (process start, imports)
  restore        clock start -> end of the first optimizer step, less one step (prepare, restore, warm-up)
  final save     the last save (relay only; the seeds are killed)
  exit           end of the last save -> kernel end
  tail           relay: the session cap not used (last step -> cap, less final save and exit);
                 seeds: the work lost at the forced end (last committed checkpoint -> kill)
  train          optimizer-step time that survives into the final model
Quota efficiency = train / billed. Extrapolated to 12 h sessions: the fixed seconds (start-up, restore, final
save, exit; and the relay's tail, which is one step + one save + the margin whatever the session length) stay;
the seeds' lost tail is taken as the same fraction of a session as measured here (epochs that take the same
share of a 12 h session as they do of this one). Target for the relay: overhead + tail <= 1 % of 12 h.

Each policy runs exactly `sessions` sessions (a count, not a time: the same on any machine), alternating
(same load). The epoch is sized from a step time measured at the start of the run (`relay train --max-steps`
on the same spec) to be `epoch_share` of a session, and the run has more epochs than fit in those sessions
even on a machine 2x faster than measured, so every session runs into the cap: the per-session efficiency is
reported as a median with its spread. (Sizing the whole run from the measured step instead failed here: the
machine's speed changed 3x during the run, and the run needed 48 sessions.)
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
TWELVE_H = 12 * 3600.0
USER = "bench"

SPEC = {
    "name": "bench-relay",
    "recipe": "toy",
    "seed": 1,
    "params": {"n_train": 16384, "n_eval": 256, "hidden": 64},
    "optim": {"micro_batch": 8, "grad_accum": 2, "lr": 0.002, "epochs": 6, "warmup_steps": 10,
              "log_every_steps": 1},
    "data": {"num_workers": 0},
    "session": {"threads": 1, "save_every": "1h", "safety_margin": "1s"},
    "checkpoints": {"keep_last": 2, "keep_best": False},
    "kaggle": {"session_timeout": "30s", "startup_overhead": "10s"},
}


# -- the seeds' session (runs inside a kernel) ---------------------------------------------------------------
def seeds_session(spec_path: str, workdir: str, resume: Optional[str], every_epochs: int) -> None:
    """The seed notebooks' policy on the relay runtime: save every N epochs, no budget, no SIGTERM handler
    (the session cap kills the process), resume from the newest epoch checkpoint."""
    from relay.kernel.run import run_session
    from relay.shared.session_plan import SessionPlan
    from relay.kernel import trainer as loop
    from relay.kernel.session import budget
    from relay.shared import spec as spec_mod

    budget.SessionClock.install_signal_handlers = lambda self: None

    def step_done(self, loss: float) -> None:
        st = self.state
        step = st.global_step + 1
        log_due = step % self.spec.optim.log_every_steps == 0 or step == self.total_steps
        self.session.step_done(loss, save=False, samples=self.stage_schedule.effective_batch, phase=self._phase,
                               started=self._started, **(self._train_fields(step) if log_due else {}))
        if self._eval_due(st.global_step):
            self.evaluate()
        if self.schedule.is_epoch_end(st.global_step):
            if (st.global_step // self.schedule.steps_per_epoch) % every_epochs == 0:
                self.save("epoch")

    loop.Trainer._step_done = step_done
    run_session(spec_mod.load(spec_path, {"session.budget": None}), Path(workdir),  # no budget
                SessionPlan(resume_from=(str(resume),) if resume else ()))


SEEDS_KERNEL = """\
import runpy, sys
sys.path.insert(0, {root!r})
runpy.run_path({bench!r})["seeds_session"]({spec!r}, {workdir!r}, {resume!r}, {every})
"""


# -- driving the emulator ------------------------------------------------------------------------------------
def _backend(emu, key: str):
    from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy

    policy = RetryPolicy(attempts=8, base_delay_s=0.05, max_delay_s=0.5, rng=random.Random(0))
    return ClientBackend(KaggleCredentials(USER, key=key), emu.url, policy, dataset_poll_s=0.1, dataset_wait_s=120)


def _wait_finished(backend, kernel: str, timeout: float = 600) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = backend.kernel_status(kernel).state
        if state.finished:
            return state.value
        time.sleep(0.2)
    raise RuntimeError(f"{kernel} did not finish in {timeout} s")


def relay_session(backend, spec_path: Path, local: Path) -> bool:
    """One session of the relay flow's loop without Prefect (observe, decide, act: flows/one_relay.py):
    push, wait, hand over. False once the relay is done."""
    from flows.one_relay import session_budget
    from relay.orchestrator import chain, handoff
    from relay.orchestrator.chain import Do
    from relay.shared import spec as spec_mod

    spec = spec_mod.load(spec_path)
    names = chain.Names(USER, spec.name)
    for _ in range(100):
        obs = handoff.observe(backend, names, local)
        action = chain.decide(spec.name, obs)
        if action.do is Do.DONE:
            return False
        if action.do is Do.PUSH:
            budget = session_budget(spec, backend.quota())
            session = handoff.session_kernel(spec, spec_path.read_text(), names, action, budget,
                                             obs.features_published, has_checkpoint=obs.published is not None)
            pushed = backend.push_session(session)
            if pushed.refusal:
                raise RuntimeError(f"push refused: {pushed.message}")
        elif action.do is Do.WAIT:
            _wait_finished(backend, names.kernel)
        elif action.do in (Do.HARVEST, Do.SALVAGE):
            result = handoff.hand_over(backend, spec, names, action, obs, local)
            if not result.ok:
                raise RuntimeError(f"hand-over of {action.run_id} failed: {result.reason}\n{result.log_tail}")
            return True
        else:
            raise RuntimeError(f"relay failed: {action.reason}")
    raise RuntimeError("relay session did not end")


def seeds_kernel_session(emu, backend, spec_path: Path, session_s: float, every_epochs: int, number: int) -> bool:
    """Session `number` of the seeds' policy (resuming from session number-1's output). False once done."""
    kernel = f"{USER}/bench-seeds"
    previous = emu.store.kernel_dir(kernel, number - 1) / "working" / "seeds"
    if number > 1 and (_read_json(previous / "progress.json") or {}).get("status") == "done":
        return False
    workdir = emu.store.kernel_dir(kernel, number) / "working" / "seeds"
    folder = Path(tempfile.mkdtemp(prefix="seeds-push-"))
    (folder / "run.py").write_text(SEEDS_KERNEL.format(root=str(ROOT), bench=str(Path(__file__).resolve()),
                                                       spec=str(spec_path), workdir=str(workdir),
                                                       resume=str(previous) if number > 1 else None,
                                                       every=every_epochs))
    (folder / "kernel-metadata.json").write_text(json.dumps({
        "id": kernel, "title": "bench seeds", "code_file": "run.py", "language": "python",
        "kernel_type": "script", "enable_gpu": True, "enable_internet": False}))
    backend.client.run("push", lambda api: api.kernels_push(str(folder), timeout=str(int(session_s))))
    shutil.rmtree(folder, ignore_errors=True)
    _wait_finished(backend, kernel)
    return True


# -- measuring -----------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _metrics(path: Path) -> list:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checkpoint_times(folder: Path) -> list:
    """(step, commit time) of the committed checkpoints a session left."""
    out = []
    for manifest in sorted(folder.glob("checkpoints/step-*/manifest.json")):
        m = _read_json(manifest) or {}
        out.append((m.get("step", 0), m.get("created", 0.0)))
    return out


def measure(emu, kernel: str, workdir_name: str, policy: str, session_s: float, effective_batch: int) -> list:
    """One record per kernel version of `kernel` (see the module docstring for the terms)."""
    rows = []
    versions = emu.store.kernels[kernel]["versions"]
    for v in versions:
        work = emu.store.kernel_dir(kernel, v["number"]) / "working" / workdir_name
        k0, k1 = v["started"], v["ended"]
        # this kernel's steps (its metrics.jsonl holds only its own lines; the time filter keeps older outputs right)
        steps = [r for r in _metrics(work / "metrics.jsonl") if r.get("kind") == "train" and r["time"] >= k0]
        progress = _read_json(work / "progress.json")
        session = ((progress or {}).get("sessions") or [None])[-1]
        if session is not None and session.get("started", 0) < k0:
            session = None  # killed before its first save: progress.json is the previous session's
        ckpts = [c for c in _checkpoint_times(work) if c[1] >= k0]
        if not steps:
            rows.append({"policy": policy, "version": v["number"], "billed_s": k1 - k0, "train_s": 0.0,
                         "steps": 0, "kept_steps": 0, "startup_s": k1 - k0, "restore_s": 0.0, "final_save_s": 0.0,
                         "exit_s": 0.0, "tail_s": 0.0, "forced_end": True})
            continue
        # step time from the session's own measurement (samples/s over the step time only), else timestamps
        n = len(steps)
        step_s = effective_batch / steps[-1]["samples_per_s"] if steps[-1].get("samples_per_s") else \
            (steps[-1]["time"] - steps[0]["time"]) / max(1, n - 1)
        first_end, last_end = steps[0]["time"], steps[-1]["time"]
        step_start = steps[0]["step"] - 1
        # the clock start: the run's progress.json for a session that saved, else the marker of the first record
        c0 = session["started"] if session else first_end - step_s
        startup = c0 - k0
        restore = max(0.0, first_end - c0 - step_s)
        done = bool(session and progress.get("status") == "done")
        if policy == "relay":
            save = float(session.get("save_seconds") or 0.0) if session else 0.0
            saved_at = float(session.get("ended") or last_end) + save if session else last_end
            exit_s = max(0.0, k1 - saved_at)
            tail = 0.0 if done else max(0.0, k0 + session_s - last_end - save - exit_s)
            kept = steps[-1]["step"] - step_start
            forced = not done
        else:  # seeds: killed at the cap; what follows the last committed checkpoint is lost
            save, exit_s = 0.0, 0.0
            if done:
                kept, tail, forced = steps[-1]["step"] - step_start, 0.0, False
                exit_s = max(0.0, k1 - last_end)
            else:
                last_ckpt_step, last_ckpt_t = max(ckpts) if ckpts else (step_start, first_end - step_s)
                kept, tail, forced = last_ckpt_step - step_start, k1 - last_ckpt_t, True
        rows.append({"policy": policy, "version": v["number"], "billed_s": k1 - k0, "steps": n, "kept_steps": kept,
                     "step_s": step_s, "train_s": kept * step_s, "startup_s": startup, "restore_s": restore,
                     "final_save_s": save, "exit_s": exit_s, "tail_s": tail, "forced_end": forced})
    return rows


def summarize(rows: list, session_s: float) -> dict:
    billed = sum(r["billed_s"] for r in rows)
    train = sum(r["train_s"] for r in rows)
    full = [r for r in rows if r["forced_end"]] or rows  # sessions that ran into the cap (not the last one)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in full)

    overhead = mean("startup_s") + mean("restore_s") + mean("final_save_s") + mean("exit_s")
    tail = mean("tail_s")
    return {"sessions": len(rows), "billed_s": billed, "train_s": train, "efficiency": train / billed if billed else 0,
            "startup_s": mean("startup_s"), "restore_s": mean("restore_s"), "final_save_s": mean("final_save_s"),
            "exit_s": mean("exit_s"), "overhead_s": overhead, "tail_s": tail}


def measure_step_s(spec: dict, work: Path, steps: int = 300) -> float:
    """Seconds per optimizer step of this spec on this machine now: `relay train --max-steps` in a child
    process, as the kernels run it (one thread), from its own samples/s (training steps only)."""
    import subprocess

    import yaml

    folder = work / "calibrate"
    folder.mkdir()
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RELAY_DEVICE": "cpu"}
    subprocess.run([sys.executable, "-m", "relay", "train", str(folder / "spec.yaml"), "--workdir",
                    str(folder / "w"), "--budget", "none", "--max-steps", str(steps)], env=env, check=True,
                   capture_output=True, cwd=folder)
    session = _read_json(folder / "w" / "progress.json")["sessions"][-1]
    effective = spec["optim"]["micro_batch"] * spec["optim"]["grad_accum"]
    return effective / session["samples_per_s"]


def size_work(spec: dict, step_s: float, session_s: float, epoch_share: float, sessions_of_work: float) -> None:
    """An epoch of `epoch_share` x a session; `sessions_of_work` sessions of training in all (each session
    trains less than its cap, so the run spans more sessions than that on any machine)."""
    effective = spec["optim"]["micro_batch"] * spec["optim"]["grad_accum"]
    steps_per_epoch = max(20, round(epoch_share * session_s / step_s))
    spec["params"]["n_train"] = steps_per_epoch * effective
    spec["optim"]["epochs"] = math.ceil(sessions_of_work / epoch_share)


def run(session_s: float = 30.0, every_epochs: int = 1, epoch_share: float = 0.25, sessions: int = 5,
        keep: bool = False) -> dict:
    """Both policies on one emulator; returns flat figures (relay_*, seeds_*, target)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import secrets

    import yaml

    from relay.emulator import Emulator, EmulatorConfig
    from sandbox import environment, temporary_files_in, work_folder  # bench/sandbox.py

    with work_folder("bench-relay-", keep) as work, environment(HOME=str(work / "home")):
        temporary_files_in(work / "tmp")  # the kaggle client keeps state in HOME and TMPDIR
        spec = json.loads(json.dumps(SPEC))
        spec["kaggle"]["session_timeout"] = f"{session_s:g}s"
        calibration_step_s = measure_step_s(spec, work)
        size_work(spec, calibration_step_s, session_s, epoch_share, 2.0 * sessions)
        spec_path = work / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        key = secrets.token_hex(16)
        emu = Emulator(work / "emulator", EmulatorConfig(
            users={USER: key}, sigterm_grace=5.0, max_gpu_sessions=1,
            kernel_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                        "RELAY_DEVICE": "cpu"})).start()
        try:
            backend = _backend(emu, key)
            # alternate the two policies' sessions, so both see the same load on this shared machine
            t0 = time.time()
            for number in range(1, sessions + 1):
                relay_session(backend, spec_path, work / "orchestrator")
                seeds_kernel_session(emu, backend, spec_path, session_s, every_epochs, number)
            effective = spec["optim"]["micro_batch"] * spec["optim"]["grad_accum"]
            relay_rows = measure(emu, f"{USER}/{spec['name']}-session", "relay", "relay", session_s, effective)
            seeds_rows = measure(emu, f"{USER}/bench-seeds", "seeds", "seeds", session_s, effective)
            relay_final = _read_json(emu.store.kernel_dir(f"{USER}/{spec['name']}-session", len(relay_rows))
                                     / "working" / "relay" / "progress.json")
            seeds_final = _read_json(emu.store.kernel_dir(f"{USER}/bench-seeds", len(seeds_rows))
                                     / "working" / "seeds" / "progress.json")
        finally:
            emu.stop()

    relay, seeds = summarize(relay_rows, session_s), summarize(seeds_rows, session_s)
    steps_per_epoch = spec["params"]["n_train"] // effective
    step_s = statistics.fmean(r["step_s"] for r in relay_rows + seeds_rows if r.get("step_s"))
    epoch_s = steps_per_epoch * step_s
    figures = {"relay_session_s": session_s, "relay_epoch_s": round(epoch_s, 2), "relay_every_epochs": every_epochs,
               "relay_bench_wall_s": round(time.time() - t0, 1),
               "relay_calibration_step_s": round(calibration_step_s, 5), "relay_n_train": spec["params"]["n_train"],
               "relay_epochs": spec["optim"]["epochs"],
               "relay_same_weights": (None if (seeds_final or {}).get("status") != "done" else
                                      (relay_final or {}).get("weights_sha256") == seeds_final.get("weights_sha256")),
               "relay_target_12h_pct": 1.0}
    for name, s in (("relay", relay), ("seeds", seeds)):
        for k, value in s.items():
            figures[f"{name}_{k}"] = round(value, 4) if isinstance(value, float) else value
    # 12 h sessions: fixed seconds stay; the relay's tail is one step + one save + the margin at any length;
    # the seeds' tail keeps its share of a session (epochs as long relative to the session as here)
    figures["relay_12h_overhead_pct"] = round(100 * relay["overhead_s"] / TWELVE_H, 4)
    figures["relay_12h_tail_pct"] = round(100 * relay["tail_s"] / TWELVE_H, 4)
    figures["relay_12h_total_pct"] = round(figures["relay_12h_overhead_pct"] + figures["relay_12h_tail_pct"], 4)
    figures["seeds_12h_overhead_pct"] = round(100 * seeds["overhead_s"] / TWELVE_H, 4)
    figures["seeds_12h_tail_pct"] = round(100 * seeds["tail_s"] / session_s, 2)
    figures["seeds_12h_total_pct"] = round(figures["seeds_12h_overhead_pct"] + figures["seeds_12h_tail_pct"], 2)
    figures["relay_12h_efficiency"] = round(1 - figures["relay_12h_total_pct"] / 100, 4)
    figures["seeds_12h_efficiency"] = round(1 - figures["seeds_12h_total_pct"] / 100, 4)
    # per session (those that ran into the cap: the last one of each policy is shorter): median and spread
    for name, rows in (("relay", relay_rows), ("seeds", seeds_rows)):
        full = [r["train_s"] / r["billed_s"] for r in rows if r["forced_end"] and r["billed_s"] > 0]
        figures[f"{name}_session_efficiency_median"] = round(statistics.median(full), 4) if full else None
        figures[f"{name}_session_efficiency_spread"] = [round(min(full), 4), round(max(full), 4)] if full else None
    figures["relay_min_sessions"] = 4
    figures["relay_meets_target"] = (figures["relay_12h_total_pct"] <= figures["relay_target_12h_pct"]
                                     and min(relay["sessions"], seeds["sessions"]) >= 4)
    return figures


def format_side_by_side(f: dict) -> str:
    rows = [
        ("sessions", "sessions", "{:d}"),
        ("billed GPU time (s)", "billed_s", "{:.1f}"),
        ("training-step time kept (s)", "train_s", "{:.1f}"),
        ("quota efficiency (train / billed)", "efficiency", "{:.1%}"),
        ("per session: start-up (s)", "startup_s", "{:.2f}"),
        ("per session: restore + 1st step (s)", "restore_s", "{:.2f}"),
        ("per session: final save (s)", "final_save_s", "{:.3f}"),
        ("per session: exit (s)", "exit_s", "{:.2f}"),
        ("per session: fixed overhead (s)", "overhead_s", "{:.2f}"),
        ("per session: tail lost at the end (s)", "tail_s", "{:.2f}"),
        ("12 h session: overhead (%)", "12h_overhead_pct", "{:.3f}"),
        ("12 h session: tail (%)", "12h_tail_pct", "{:.3f}"),
        ("12 h session: overhead + tail (%)", "12h_total_pct", "{:.3f}"),
        ("12 h session: quota efficiency", "12h_efficiency", "{:.2%}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"quota efficiency, toy workload, {f['relay_session_s']:g} s sessions on the emulator, epoch "
             f"{f['relay_epoch_s']} s ({f['relay_epoch_s'] / f['relay_session_s']:.0%} of a session; the seeds' 12 h"
             f" tail keeps that share), seeds checkpoint every {f['relay_every_epochs']} epoch(s)",
             f"{'':<{width}}{'relay':>12}{'seeds':>12}"]
    for label, key, fmt in rows:
        lines.append(f"{label:<{width}}{fmt.format(f['relay_' + key]):>12}{fmt.format(f['seeds_' + key]):>12}")
    ok = f["relay_12h_total_pct"] <= f["relay_target_12h_pct"]
    lines.append(f"relay overhead + tail in a 12 h session: {f['relay_12h_total_pct']:.3f} % "
                 f"(target <= {f['relay_target_12h_pct']:g} %)  {'OK' if ok else 'MISSED'}")
    for name in ("relay", "seeds"):
        lines.append(f"{name}: efficiency per full session, median {f[name + '_session_efficiency_median']:.2%} "
                     f"(spread {f[name + '_session_efficiency_spread']}) over {f[name + '_sessions']} sessions "
                     f"(>= {f['relay_min_sessions']} each: {'OK' if f[name + '_sessions'] >= 4 else 'MISSED'})")
    lines.append(f"work sized from a measured step ({f['relay_calibration_step_s'] * 1000:.2f} ms): "
                 f"{f['relay_n_train']} samples x {f['relay_epochs']} epochs")
    lines.append("final weights of both policies identical: " + ("not compared (neither policy runs to the end"
                 " here; tests/kernel/test_resume.py proves exact resume)" if f["relay_same_weights"] is None else str(f["relay_same_weights"])))
    return "\n".join(lines)


if __name__ == "__main__":
    figures = run(keep="--keep" in sys.argv)
    print(format_side_by_side(figures))
    print(json.dumps(figures, indent=1))
