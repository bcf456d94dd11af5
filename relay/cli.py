"""The `relay` command. Each subcommand is a thin shell over a library function."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from relay.shared import accelerators
from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser


def _budget(value: str) -> Optional[float]:
    from relay.shared.spec import parse_duration

    try:
        return parse_duration(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(value: str, expected: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected {expected} (got {value!r})")
    return number


def _steps(value: str) -> Optional[int]:
    if value.strip().lower() == "none":
        return None
    return _positive(value, "a positive number of steps or 'none'")


def _session_number(value: str) -> int:
    return _positive(value, "a session number, 1 or more")


def _deadline(value: str) -> float:
    try:
        deadline = float(value)
    except ValueError:
        deadline = float("nan")
    if not math.isfinite(deadline) or deadline <= 0:
        raise argparse.ArgumentTypeError(f"expected a unix time in seconds, e.g. 1767225600 (got {value!r})")
    return deadline


def cmd_train(args: argparse.Namespace) -> int:
    from relay.kernel.run import run_session
    from relay.front_door import load_spec

    from relay.shared.session_plan import SessionPlan

    # the session's plan (the kernel script writes it: relay/shared/session_plan.py), trusted as it is; a flag
    # given beside it wins, and the flags alone (by hand, the kernels pushed before the plan) work as they did
    plan = SessionPlan.read(args.plan) if args.plan else SessionPlan()
    overrides = {}
    if args.budget is not _UNSET:
        overrides["session.budget"] = args.budget
    if args.max_steps is not _UNSET:
        overrides["session.max_steps"] = args.max_steps
    spec = load_spec(args.spec, overrides)
    budget = plan.budget if plan.budget is not None and args.budget is _UNSET else spec.session.budget
    deadline = args.deadline if args.deadline is not None else plan.deadline
    resume_from = args.resume_from or list(plan.resume_from)
    data = args.data or plan.data
    features = args.features or list(plan.features)
    run_id = args.run_id or plan.run_id
    if spec.code is not None and spec.code.entry:  # the user's own loop (relay/kernel/entry.py)
        from relay.kernel import entry

        from relay.kernel.session.settings import SessionSettings

        config = SessionSettings.from_spec(
            spec, Path(args.workdir), budget=budget, deadline=deadline,
            max_steps=spec.session.max_steps, resume_from=resume_from, data_dir=data,
            feature_dirs=features, run_id=run_id)
        progress = entry.run_entry(spec, config)
        print(f"relay: {progress['status']} at step {progress['global_step']}/{progress['total_steps']}"
              f" (session {len(progress['sessions'])}, stop: {progress['stop_reason']});"
              f" weights {(progress['weights_sha256'] or '?')[:16]}")
        return 0
    progress = run_session(
        spec, Path(args.workdir), budget=budget, deadline=deadline,
        resume_from=[Path(p) for p in resume_from], data_dir=Path(data) if data else None,
        feature_dirs=[Path(p) for p in features], run_id=run_id,
    )
    m = progress["metrics"]
    metric = ", ".join(f"{k}={v:.4g}" for k, v in m.items() if k != "step")
    print(f"relay: {progress['status']} at step {progress['global_step']}/{progress['total_steps']}"
          f" (epoch {progress['epoch']}, session {len(progress['sessions'])}, stop: {progress['stop_reason']})"
          f"{' ' + metric if metric else ''}; weights {progress['weights_sha256'][:16]}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from relay.kernel.recipes import legal_data, price_data, recsys_data, temporal_data, vqa_data

    generators = {"price-model": price_data.main, "vqa": vqa_data.main, "legal": legal_data.main,
                  "temporal": temporal_data.main, "recsys": recsys_data.main}
    return generators[args.workload](args.rest) or 0


def cmd_plan(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from relay.orchestrator import measured, plan as planner, policy
    from relay.front_door import load_spec

    spec = load_spec(args.spec)
    progress = _load_progress(args.progress) if args.progress else {}
    # start-up, save and hand-over: the flags, else measured over this run's records (--progress) or a previous
    # relay's (--from NAME: its published progress.json, read from Kaggle), else the spec's and the defaults
    measured_from = _previous_relay(args.from_relay, args.credentials_block) if args.from_relay else progress
    figures = measured.overheads(spec, measured_from, startup=args.startup, save=args.save, handover=args.handover)
    total = None
    if not progress:
        if spec.optim.max_steps:
            total = spec.optim.max_steps
        elif args.train_samples:
            total = spec.optim.epochs * (args.train_samples // (spec.optim.micro_batch * spec.optim.grad_accum))
        if total is None:
            raise InputError("relay plan: the run's length is unknown before its first session:"
                             " pass --train-samples N (the training set size) or set optim.max_steps")
        if args.step_seconds is None:
            raise InputError("relay plan: no session has measured a step yet: pass --step-seconds S")
    now = datetime.now(timezone.utc)
    ledger = [(s["started"], s.get("seconds", 0.0)) for s in progress.get("sessions", [])]
    quota = planner.quota_from_ledger(ledger, now, total_allowed_s=spec.kaggle.weekly_gpu_quota)
    limits = policy.plan_limits(spec, figures)
    try:
        plan = planner.plan_from_progress(progress, quota, now, limits=limits, step_seconds_estimate=args.step_seconds,
                                          total_steps=total, steps_per_epoch=progress.get("steps_per_epoch"))
    except planner.PlanError as err:
        raise InputError(f"relay plan: {err} (see relay plan --help)") from None
    print(planner.format_plan(plan))
    print(measured.goodput_line(measured.expected_goodput(plan.sessions, figures, spec.session.save_every), figures,
                                spec.kaggle.weekly_gpu_quota)
          + (f"; figures of relay {args.from_relay}" if args.from_relay else ""))
    procs = spec.session.devices if spec.session.devices != "auto" else accelerators.gpus_of(spec.kaggle.machine_shape)
    if spec.recipe is not None:
        from relay.kernel.usercode import recipe_params  # a user recipe's Params are in its own module

        fit_only = recipe_params(spec).fit_only
    else:
        fit_only = False
    why = f"recipe {spec.recipe} is made only of fit stages" if fit_only else f"machine {spec.kaggle.machine_shape}"
    print(f"processes per session: {1 if fit_only else procs} (session.devices: {spec.session.devices}, {why});"
          " step times are of one optimizer step with all of them")
    return 0


def _previous_relay(name: str, credentials_block: Optional[str]) -> dict:
    """The published progress.json of relay NAME (its sessions' and charges' records), read from Kaggle."""
    from relay.orchestrator import status

    found = status.find_relay(name, lambda: _backend(credentials_block), "relay plan --from")
    if not (found[4].published or {}).get("sessions"):
        raise InputError(f"relay plan --from {name}: the relay has handed no session over yet: nothing measured")
    return found[4].published


def _backend(credentials_block: Optional[str]):
    """Kaggle (or the emulator at RELAY_KAGGLE_ENDPOINT) with the account of a Prefect Secret block, or of the
    environment / ~/.kaggle without one."""
    if credentials_block:
        from tasks.relay_step import make_backend

        return make_backend(credentials_block)
    from relay.orchestrator.kaggle import from_env

    return from_env()


CREDENTIALS_BLOCK_HELP = ("Kaggle credentials from this Prefect Secret block ({\"username\", \"key\"} JSON) instead of"
                          " the spec's kaggle.credentials_block, the environment or ~/.kaggle")


def cmd_status(args: argparse.Namespace) -> int:
    from relay.orchestrator import report

    if not Path(args.dir).is_dir():  # a relay name or a spec: read from Kaggle
        from relay.orchestrator import status

        _, run_spec = status.resolve_name(args.dir)
        block = args.credentials_block or run_spec.kaggle.credentials_block
        return status.report(args.dir, lambda: _backend(block), Path(args.out) if args.out else None)
    progress = _load_progress(args.dir)
    print(report.format_table(report.session_table(progress)))
    best = progress.get("best") or {}
    print(f"\n{progress['status']}: step {progress['global_step']}/{progress['total_steps']},"
          f" last eval {progress.get('metrics')}, best {best.get('metric')}={best.get('value')}")
    out = Path(args.dir) if Path(args.dir).is_dir() else Path(args.dir).parent
    if report.read_metrics(out):  # a folder the relay wrote may hold progress.json without metrics.jsonl
        print(f"curves: {report.plot_curves(out, out / 'curves.png', progress=progress)}")
    else:
        print(f"curves: none (no metrics.jsonl records under {out})")
    if progress.get("sessions"):
        print(f"timeline: {report.plot_timeline(progress['sessions'], out / 'timeline.png')}")
    return 0


def _load_progress(path: str) -> dict:
    from relay.orchestrator import report

    try:
        return report.load_progress(path)
    except (FileNotFoundError, ValueError) as err:  # none there, or one that is not JSON
        raise InputError(f"{err}; expected a workdir or harvested outputs with a progress.json") from None


def _relay_backend(args: argparse.Namespace):
    """The backend factory for the relay that NAME|SPEC names: --credentials-block, else the spec's
    kaggle.credentials_block, else the environment or ~/.kaggle (the account `relay run` used)."""
    from relay.orchestrator import status

    _, run_spec = status.resolve_name(args.target, f"relay {args.command}")
    block = args.credentials_block or run_spec.kaggle.credentials_block
    return lambda: _backend(block)


def cmd_stop(args: argparse.Namespace) -> int:
    from relay.orchestrator import control

    return control.stop(args.target, _relay_backend(args), now=args.now, yes=args.yes, why=args.why)


def cmd_resume(args: argparse.Namespace) -> int:
    from relay.orchestrator import control

    return control.resume(args.target, _relay_backend(args))


def cmd_logs(args: argparse.Namespace) -> int:
    from relay.orchestrator import logs

    def write(line: str) -> None:
        print(line, flush=True)

    return logs.logs(args.target, _relay_backend(args), session=args.session, follow=args.follow, write=write)


def cmd_verify_resume(args: argparse.Namespace) -> int:
    from relay.kernel.verify import parse_cuts, verify_resume

    verdict = verify_resume(Path(args.spec), args.steps, seed=args.seed,
                            workdir=Path(args.workdir) if args.workdir else None,
                            cut_at=parse_cuts(args.cut_at) if args.cut_at is not None else None)
    print(verdict.text())
    return 0 if verdict.identical else 1


def cmd_run(args: argparse.Namespace) -> int:
    from relay import launch

    return launch.run(args.spec, args.out, tick=args.tick, poll_seconds=args.poll, submit=args.submit,
                      credentials_block=args.credentials_block)


def cmd_doctor(args: argparse.Namespace) -> int:
    from relay import doctor
    from relay.orchestrator.kaggle import from_env

    return doctor.run(args.spec, from_env, timeout_s=args.timeout, poll_s=args.poll)


def cmd_emulator(args: argparse.Namespace) -> int:
    from relay.emulator.serve_command import main as emulator_main

    return emulator_main(args.rest) or 0


def cmd_init(args: argparse.Namespace) -> int:
    import tempfile

    from relay import __version__
    from relay.front_door import load_spec
    from relay.orchestrator import repo_init

    root = Path(args.path)
    files = repo_init.plan(root, args.entry, __version__, name=args.name, spec=args.spec,
                           wheel=Path(args.wheel) if args.wheel else None, git=args.git)
    # the skeleton through the front door (the entry exists, a notebook's cells run) before anything is written;
    # the draft sits at the root (code.folder "."), so no folder of the spec's path is made for it
    with tempfile.NamedTemporaryFile("w", dir=root, prefix=".relay-init-", suffix=".yaml") as draft:
        draft.write(files.draft)
        draft.flush()
        try:
            load_spec(draft.name)
        except InputError as err:  # named as the file it would be
            raise InputError(str(err).replace(draft.name, args.spec)) from None
    written = repo_init.write(files)
    print(f"relay init: wrote {', '.join(written)} in {root}; the workflow installs {files.install}")
    print(f"next: the Session API in your code (docs/your-code.md), `relay verify-resume {args.spec} --steps 60`,"
          " the repository secrets KAGGLE_USERNAME and KAGGLE_KEY, then commit and push: the workflow ticks every"
          " 15 minutes (or run it from the Actions tab)")
    return 0


_UNSET = object()


def build_parser() -> argparse.ArgumentParser:
    # one table of subcommands and their options, read top to bottom (the reference page is generated from it)
    parser = OneLineArgumentParser(prog="relay", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run ONE training session locally, resuming from the newest checkpoint")
    t.add_argument("spec", help="run spec YAML")
    t.add_argument("--workdir", required=True, help="session folder: checkpoints, progress.json, metrics")
    t.add_argument("--budget", type=_budget, default=_UNSET,
                   help="wall-clock seconds (or 11h30m) for this session, 'none' to run to the end;"
                        " default: the spec's session.budget")
    t.add_argument("--max-steps", type=_steps, default=_UNSET, metavar="N|none",
                   help="optimizer steps for this session, 'none' for no cap; default: the spec's session.max_steps")
    t.add_argument("--deadline", type=_deadline, help="absolute unix time the session must end by")
    t.add_argument("--resume-from", action="append", default=[], metavar="DIR",
                   help="read-only checkpoint location (a mounted dataset); repeatable")
    t.add_argument("--data", help="recipe data folder (overrides params.data_dir)")
    t.add_argument("--features", action="append", default=[], metavar="DIR",
                   help="read-only feature cache (a mounted dataset); repeatable")
    t.add_argument("--run-id", help="id chosen by the orchestrator, written into progress and manifests")
    t.add_argument("--plan", metavar="FILE", help="the session's plan as the kernel script writes it (JSON: run"
                   " id, budget, deadline, resume, data and feature folders); a flag given too wins")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("data", help="generate synthetic data shaped like a workload's real files")
    d.add_argument("workload", choices=["price-model", "vqa", "legal", "temporal", "recsys"])
    d.add_argument("rest", nargs=argparse.REMAINDER, help="the generator's options (--out DIR --train N ...)")
    d.set_defaults(func=cmd_data)

    p = sub.add_parser("plan", help="sessions left, their budgets and start times within the weekly quota")
    p.add_argument("spec")
    p.add_argument("--progress", metavar="DIR", help="a workdir or harvested outputs (measured step time, steps done)")
    p.add_argument("--step-seconds", type=float, help="seconds per optimizer step, before any session measured it")
    p.add_argument("--train-samples", type=int, help="training set size, to count steps of an epochs-based spec")
    p.add_argument("--startup", type=_budget, metavar="DURATION", help="a session's start-up, push to its first"
                                                                       " step (default: measured, else"
                                                                       " kaggle.startup_overhead)")
    p.add_argument("--save", type=_budget, metavar="DURATION", help="one checkpoint save (default: measured, else"
                                                                    " session.safety_margin)")
    p.add_argument("--handover", type=_budget, metavar="DURATION", help="from a session's end to the next one's"
                                                                        " push (default: measured, else 1m)")
    p.add_argument("--from", dest="from_relay", metavar="NAME", help="measure start-up, save and hand-over over a"
                                                                     " previous relay's sessions (read from Kaggle)")
    p.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    p.set_defaults(func=cmd_plan)

    st = sub.add_parser("status", help="where a relay stands: its session table, running session, next step, ETA"
                                       " and PNGs, read from Kaggle (NAME or SPEC) or from a local folder")
    st.add_argument("dir", metavar="NAME|SPEC|DIR",
                    help="a relay name or its spec (read from Kaggle), or a workdir / harvested outputs folder")
    st.add_argument("--out", metavar="DIR", help="where the PNGs go for NAME|SPEC (default: relay-runs/NAME)")
    st.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    st.set_defaults(func=cmd_status)

    sp = sub.add_parser("stop", help="stop a relay: its running session is handed over as usual, then nothing more"
                                     " is pushed, by any orchestrator (the stop is recorded on Kaggle)")
    sp.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    sp.add_argument("--now", action="store_true", help="also end the running session now by deleting its kernel (Kaggle"
                                                      " has no cancel): its progress since the last published"
                                                      " checkpoint is lost; says how much and asks first")
    sp.add_argument("--yes", action="store_true", help="with --now: do not ask")
    sp.add_argument("--why", default="", help="a note kept with the stop (shown by relay status)")
    sp.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    sp.set_defaults(func=cmd_stop)

    rs = sub.add_parser("resume", help="resume a stopped relay: the next `relay run` or tick goes on from its last"
                                       " published checkpoint")
    rs.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    rs.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    rs.set_defaults(func=cmd_resume)

    lg = sub.add_parser("logs", help="a session's log from Kaggle (the running one by default), each line once")
    lg.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    lg.add_argument("--session", type=_session_number, metavar="N", help="session N's log (default: the kernel's"
                                                                          " current session)")
    lg.add_argument("--follow", action="store_true", help="follow the running session's log until it ends")
    lg.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    lg.set_defaults(func=cmd_logs)

    v = sub.add_parser("verify-resume", help="N steps straight vs the same N split into sessions with a SIGKILL"
                                              " mid-save: 'identical', or the first tensor that differs")
    v.add_argument("spec")
    v.add_argument("--steps", type=_steps, default=None, help="optimizer steps to compare (default 3 sessions' worth)")
    v.add_argument("--seed", type=int, default=0, help="picks the random cut points")
    v.add_argument("--cut-at", metavar="STEPS", help="the steps to cut the split run at, e.g. 32,64 (default: the"
                                                     " first epoch ends, log and eval steps, and 3 random steps)")
    v.add_argument("--workdir", help="where both runs go (default: a new temporary folder)")
    v.set_defaults(func=cmd_verify_resume)

    r = sub.add_parser("run", help="run the relay of a spec on Kaggle to the end (or one tick with --tick), on an"
                                    " embedded Prefect; stop it anywhere and run it again to continue")
    r.add_argument("spec", help="run spec YAML, relative to the current folder (paths inside it: to its folder)")
    r.add_argument("--out", metavar="DIR", help="where the session table, PNGs and Kaggle facts go (default:"
                                                " relay-runs/ beside the spec)")
    r.add_argument("--tick", action="store_true", help="do what needs no waiting (a hand-over, the next push) and return (cron, GitHub Actions)")
    r.add_argument("--poll", type=float, metavar="SECONDS",
                   help="seconds between status checks (default 30; 2 against the emulator)")
    r.add_argument("--submit", action="store_true",
                   help="run it on the Prefect server at PREFECT_API_URL (deployment relay/run, whose worker must see"
                        " the same paths) and follow it here")
    r.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    r.set_defaults(func=cmd_run)

    dr = sub.add_parser("doctor", help="check an account before spending GPU quota: credentials, quota, data"
                                       " sources, and a CPU canary kernel that starts as a session would")
    dr.add_argument("spec", nargs="?", help="run spec YAML (without it: credentials and quota only)")
    dr.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the canary kernel")
    dr.add_argument("--poll", type=float, default=5.0, help="seconds between its status checks")
    dr.set_defaults(func=cmd_doctor)

    it = sub.add_parser("init", help="make a repository relay itself: a spec skeleton for its entry and a GitHub"
                                     " Actions workflow that ticks it with a pinned kaggle-relay (writes only new files)")
    it.add_argument("path", nargs="?", default=".", help="the repository's root (default: the current folder)")
    it.add_argument("--entry", required=True, help="what a session runs: 'train.py --lr 3e-4', 'train.ipynb' or"
                                                   " 'module:function', relative to PATH")
    it.add_argument("--name", help="the relay's name (default: from the folder's name)")
    it.add_argument("--spec", default="spec.yaml", help="the spec to write, relative to PATH (default spec.yaml)")
    source = it.add_mutually_exclusive_group()
    source.add_argument("--wheel", metavar="FILE", help="install kaggle-relay from this wheel, copied to"
                                                        " .github/relay/ (default: kaggle-relay==VERSION from PyPI)")
    source.add_argument("--git", metavar="URL[@REF]", help="install kaggle-relay from this git repository (REF"
                                                           " default: the tag vVERSION)")
    it.set_defaults(func=cmd_init)

    e = sub.add_parser("emulator", help="the local Kaggle API emulator (relay emulator serve --help)")
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_emulator)
    return parser


# What only training needs; an orchestrator-only install (run, status, doctor, plan) has none of it.
TRAINING_STACK = ("torch", "transformers", "tokenizers", "safetensors", "pyarrow", "pandas", "psutil", "PIL")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:  # one line per HTTP request of the Prefect client says nothing to a user
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except InputError as err:
        print(f"relay: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `relay status NAME | head`: the reader took what it wanted and closed the pipe
        try:  # the interpreter's last flush at exit then writes nowhere, not a second traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141  # as a shell reports a command ended by SIGPIPE (128 + 13)
    except ModuleNotFoundError as err:
        if err.name not in TRAINING_STACK:
            raise
        print(f"relay: error: relay {args.command} needs the training stack ({err.name} is not installed):"
              " pip install 'kaggle-relay[train]'", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - only Kaggle's failures are answered here; anything else is a bug
        types = sys.modules.get("relay.orchestrator.kaggle.types")  # loaded by whatever talked to Kaggle
        if types is None or not isinstance(err, types.KaggleError):
            raise
        print(f"relay: error: {err}", file=sys.stderr)  # one line naming the call, never a traceback
        return 1


if __name__ == "__main__":
    sys.exit(main())
