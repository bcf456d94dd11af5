"""What each `relay` subcommand does, given its parsed arguments (relay/cli.py parses them): a thin shell over
the library function that does the work, importing it only when the subcommand runs (an orchestrator-only
install has no training stack, and `relay status` should not pay for torch's import)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from relay.shared import accelerators
from relay.shared.errors import InputError
from relay.shared.progress import Progress

UNSET = object()  # a flag not given, told apart from one given as 'none' (None)


# `relay train`'s flags that make a session's plan by hand; with --plan the plan says all of it
PLAN_FLAGS = (("budget", "--budget"), ("deadline", "--deadline"), ("resume_from", "--resume-from"),
              ("data", "--data"), ("features", "--features"), ("run_id", "--run-id"))


def session_plan(args: argparse.Namespace):
    """The session's plan: --plan's file as the orchestrator made it, else the one the flags make. A plan flag beside
    --plan is refused (one line): the plan is the session's whole say, never overridden."""
    from relay.shared.session_plan import SessionPlan

    given = [flag for name, flag in PLAN_FLAGS
             if (args.budget is not UNSET if name == "budget" else getattr(args, name) not in (None, []))]
    if args.plan:
        if given:
            raise InputError(f"relay train: {', '.join(given)} given with --plan {args.plan}: the plan says the"
                             " session's budget, run id and folders; give either the plan or the flags")
        return SessionPlan.read(args.plan)
    # --budget overrides the spec's session.budget (load_spec's overrides), which a plan's budget None means
    return SessionPlan(run_id=args.run_id, deadline=args.deadline, resume_from=tuple(args.resume_from),
                       data_dir=args.data, feature_dirs=tuple(args.features))


def cmd_train(args: argparse.Namespace) -> int:
    from relay.kernel.run import run_session
    from relay.front_door import load_spec

    plan = session_plan(args)
    overrides = {}
    if args.budget is not UNSET:
        overrides["session.budget"] = args.budget
    if args.max_steps is not UNSET:
        overrides["session.max_steps"] = args.max_steps
    spec = load_spec(args.spec, overrides)
    if spec.code is not None and spec.code.entry:  # the user's own loop (relay/kernel/entry.py)
        from relay.kernel import entry

        from relay.kernel.session.settings import SessionSettings

        progress = entry.run_entry(spec, SessionSettings.from_spec(spec, Path(args.workdir), plan))
        print(_session_line(Progress.read(progress), with_metrics=False))
        return 0
    progress = run_session(spec, Path(args.workdir), plan)
    print(_session_line(Progress.read(progress), with_metrics=True))
    return 0


def _session_line(progress: Progress, with_metrics: bool) -> str:
    """What `relay train` prints at its end: a built-in recipe's with its epoch and last eval, a user loop's with
    its weights ('?' before it exported any)."""
    if not with_metrics:
        return (f"relay: {progress.status} at step {progress.global_step}/{progress.total_steps}"
                f" (session {len(progress.sessions)}, stop: {progress.stop_reason});"
                f" weights {(progress.weights_sha256 or '?')[:16]}")
    metric = ", ".join(f"{k}={v:.4g}" for k, v in progress.metrics.items() if k != "step")
    return (f"relay: {progress.status} at step {progress.global_step}/{progress.total_steps}"
            f" (epoch {progress.epoch}, session {len(progress.sessions)}, stop: {progress.stop_reason})"
            f"{' ' + metric if metric else ''}; weights {progress.weights_sha256[:16]}")


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
    progress = _load_progress(args.progress) if args.progress else None
    # start-up, save and hand-over: the flags, else measured over this run's records (--progress) or a previous
    # relay's (--from NAME: its published progress.json, read from Kaggle), else the spec's and the defaults
    quota_seen = None  # Kaggle's quota statistics, read where the plan reads Kaggle anyway (--from)
    if args.from_relay:
        measured_from, quota_seen = _previous_relay(args.from_relay, args.credentials_block)
    else:
        measured_from = progress
    figures = measured.overheads(spec, measured_from, startup=args.startup, save=args.save, handover=args.handover)
    total = None
    step_seconds = args.step_seconds if args.step_seconds is not None else spec.session.step_seconds
    if progress is None:
        if spec.optim.max_steps:
            total = spec.optim.max_steps
        elif args.train_samples:
            total = spec.optim.epochs * (args.train_samples // (spec.optim.micro_batch * spec.optim.grad_accum))
        if total is None:
            raise InputError("relay plan: the run's length is unknown before its first session:"
                             " pass --train-samples N (the training set size) or set optim.max_steps")
        if step_seconds is None:
            raise InputError("relay plan: no session has measured a step yet: pass --step-seconds S"
                             " or set session.step_seconds in the spec")
    now = datetime.now(timezone.utc)
    quota = policy.quota_state(spec, progress, quota_seen, now)  # the one rule `relay status` and the summary use
    limits = policy.plan_limits(spec, figures)
    try:
        plan = planner.plan_from_progress(progress or Progress(), quota, now, limits=limits,
                                          step_seconds_estimate=step_seconds, total_steps=total,
                                          steps_per_epoch=progress.steps_per_epoch if progress else None)
    except planner.PlanError as err:
        raise InputError(f"relay plan: {err} (see relay plan --help)") from None
    print(planner.format_plan(plan))
    assumed = [f for f in (figures.startup, figures.save, figures.handover) if f.source.startswith("assumed")]
    print(measured.goodput_line(measured.expected_goodput(plan.sessions, figures, spec.session.save_every), figures,
                                spec.kaggle.weekly_gpu_quota)
          + (f"; figures of relay {args.from_relay}" if args.from_relay else "")
          + ("; assumed figures are measured by `relay plan --from NAME` (a relay that ran) or --progress DIR"
             if assumed and not args.from_relay else ""))
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


def _previous_relay(name: str, credentials_block: Optional[str]) -> tuple:
    """The published progress.json of relay NAME (its sessions' and charges' records), read from Kaggle, and the
    account's quota statistics (None when Kaggle gave none)."""
    from relay.orchestrator import status

    made: list = []  # the backend find_relay makes (its errors are its own to say), asked the quota after
    found = status.find_relay(name, lambda: made.append(_backend(credentials_block)) or made[-1], "relay plan --from")
    published = Progress.read(found[4].published)
    if published is None or not published.sessions:
        raise InputError(f"relay plan --from {name}: the relay has handed no session over yet: nothing measured")
    try:
        quota = made[-1].quota() if made else None  # the account's quota, as `relay status` reads it
    except Exception:  # noqa: BLE001 - the plan then assumes the weekly reset, and says so
        quota = None
    return published, quota


def _backend(credentials_block: Optional[str]):
    """Kaggle (or the emulator at RELAY_KAGGLE_ENDPOINT) with the account of a Prefect Secret block, or of the
    environment / ~/.kaggle without one."""
    if credentials_block:
        from tasks.relay_host import make_backend

        return make_backend(credentials_block)
    from relay.orchestrator.kaggle import from_env

    return from_env()


def cmd_status(args: argparse.Namespace) -> int:
    from relay.orchestrator import attempts, report
    from relay.shared import runtime

    if not Path(args.dir).is_dir():  # a relay name or a spec: read from Kaggle
        from relay.orchestrator import status

        _, run_spec = status.resolve_name(args.dir)
        block = args.credentials_block or run_spec.kaggle.credentials_block
        return status.report(args.dir, lambda: _backend(block), Path(args.out) if args.out else None)
    progress = _load_progress(args.dir)
    print(report.format_table(report.session_table(progress)))
    for note in runtime.change_notes([s.as_mapping() for s in progress.sessions]):  # another CPU, GPU, torch ...
        print(f"warning: {note}")
    best = progress.best or {}
    print(f"\n{progress.status}: step {progress.global_step}/{progress.total_steps},"
          f" last eval {progress.metrics}, best {best.get('metric')}={best.get('value')}")
    out = Path(args.dir) if Path(args.dir).is_dir() else Path(args.dir).parent
    if report.read_metrics(out):  # a folder the relay wrote may hold progress.json without metrics.jsonl
        print(f"curves: {report.plot_curves(out, out / 'curves.png', progress=progress)}")
    else:
        print(f"curves: none (no metrics.jsonl records under {out})")
    if progress.sessions:
        print(f"timeline: {report.plot_timeline(attempts.every_attempt(progress), out / 'timeline.png')}")
    if progress.charges:  # a relay's published progress: what Kaggle charged each attempt, as it saw it
        from relay.orchestrator import goodput, goodput_chart

        ledger = goodput.from_progress(progress)
        print(ledger.line())
        print(f"goodput chart: {goodput_chart.plot_goodput(ledger, out / 'goodput.png')}")
    return 0


def _load_progress(path: str) -> Progress:
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

    if args.probe:
        if args.spec:
            raise InputError("relay doctor --probe takes no spec: it checks the account, not a relay")
        from relay.orchestrator import probe

        return probe.probe(from_env(), report=args.report, timeout_s=args.timeout, poll_s=args.poll)
    if args.report:
        raise InputError("relay doctor --report goes with --probe")
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
    for note in files.notes:
        print(f"relay init: note: {note}")
    print(f"next: the Session API in your code (docs/your-code.md), `relay verify-resume {args.spec} --steps 60`,"
          " the repository secrets KAGGLE_USERNAME and KAGGLE_KEY, then commit and push: the workflow ticks every"
          " 15 minutes (or run it from the Actions tab)")
    return 0
