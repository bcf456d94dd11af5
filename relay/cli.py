"""The `relay` command line: its subcommands and their options in one table (the reference page,
docs/reference/cli.md, is generated from it), and `main`, which turns what goes wrong into one line and an exit
status. What each subcommand does is relay/commands.py."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Optional, Sequence

from relay import commands
from relay.commands import UNSET
from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser

DESCRIPTION = ("kaggle-relay: train past Kaggle's session limit, as a relay of sessions that each resume from the"
               " last one's checkpoint")


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


CREDENTIALS_BLOCK_HELP = ("Kaggle credentials from this Prefect Secret block ({\"username\", \"key\"} JSON) instead of"
                          " the spec's kaggle.credentials_block, the environment or ~/.kaggle")




def build_parser() -> argparse.ArgumentParser:
    # one table of subcommands and their options, read top to bottom (the reference page is generated from it)
    parser = OneLineArgumentParser(prog="relay", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run ONE training session locally, resuming from the newest checkpoint")
    t.add_argument("spec", help="run spec YAML")
    t.add_argument("--workdir", required=True, help="session folder: checkpoints, progress.json, metrics")
    t.add_argument("--budget", type=_budget, default=UNSET,
                   help="wall-clock seconds (or 11h30m) for this session, 'none' to run to the end;"
                        " default: the spec's session.budget")
    t.add_argument("--max-steps", type=_steps, default=UNSET, metavar="N|none",
                   help="optimizer steps for this session, 'none' for no cap; default: the spec's session.max_steps")
    t.add_argument("--deadline", type=_deadline, help="absolute unix time the session must end by")
    t.add_argument("--resume-from", action="append", default=[], metavar="DIR",
                   help="read-only checkpoint location (a mounted dataset); repeatable")
    t.add_argument("--data", help="recipe data folder (overrides params.data_dir)")
    t.add_argument("--features", action="append", default=[], metavar="DIR",
                   help="read-only feature cache (a mounted dataset); repeatable")
    t.add_argument("--run-id", help="id chosen by the orchestrator, written into progress and manifests")
    t.add_argument("--plan", metavar="FILE", help="the session's plan as the orchestrator made it (JSON: run id,"
                   " budget, deadline, datasets to resume from, data, features); without it the flags above make"
                   " one, beside it they are refused")
    t.set_defaults(func=commands.cmd_train)

    d = sub.add_parser("data", help="generate synthetic data shaped like a workload's real files")
    d.add_argument("workload", choices=["price-model", "vqa", "legal", "temporal", "recsys"])
    d.add_argument("rest", nargs=argparse.REMAINDER, help="the generator's options (--out DIR --train N ...)")
    d.set_defaults(func=commands.cmd_data)

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
    p.set_defaults(func=commands.cmd_plan)

    st = sub.add_parser("status", help="where a relay stands: its session table, running session, next step, ETA"
                                       " and PNGs, read from Kaggle (NAME or SPEC) or from a local folder")
    st.add_argument("dir", metavar="NAME|SPEC|DIR",
                    help="a relay name or its spec (read from Kaggle), or a workdir / harvested outputs folder")
    st.add_argument("--out", metavar="DIR", help="where the PNGs go for NAME|SPEC (default: relay-runs/NAME)")
    st.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    st.set_defaults(func=commands.cmd_status)

    sp = sub.add_parser("stop", help="stop a relay: its running session is handed over as usual, then nothing more"
                                     " is pushed, by any orchestrator (the stop is recorded on Kaggle)")
    sp.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    sp.add_argument("--now", action="store_true", help="also end the running session now by deleting its kernel (Kaggle"
                                                      " has no cancel): its progress since the last published"
                                                      " checkpoint is lost; says how much and asks first")
    sp.add_argument("--yes", action="store_true", help="with --now: do not ask")
    sp.add_argument("--why", default="", help="a note kept with the stop (shown by relay status)")
    sp.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    sp.set_defaults(func=commands.cmd_stop)

    rs = sub.add_parser("resume", help="resume a stopped relay: the next `relay run` or tick goes on from its last"
                                       " published checkpoint")
    rs.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    rs.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    rs.set_defaults(func=commands.cmd_resume)

    lg = sub.add_parser("logs", help="a session's log from Kaggle (the running one by default), each line once")
    lg.add_argument("target", metavar="NAME|SPEC", help="a relay name or its spec")
    lg.add_argument("--session", type=_session_number, metavar="N", help="session N's log (default: the kernel's"
                                                                          " current session)")
    lg.add_argument("--follow", action="store_true", help="follow the running session's log until it ends")
    lg.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    lg.set_defaults(func=commands.cmd_logs)

    v = sub.add_parser("verify-resume", help="N steps straight vs the same N split into sessions with a SIGKILL"
                                              " mid-save: 'identical', or the first tensor that differs",
                       epilog="RELAY_WARM_MODULES=torch,torch._dynamo (modules, comma-separated) forks each session"
                              " from a process that imported them once instead of a fresh interpreter (~2.5 CPU s"
                              " less a session); off by default (docs/your-code.md)")
    v.add_argument("spec")
    v.add_argument("--steps", type=_steps, default=None, help="optimizer steps to compare (default 3 sessions' worth)")
    v.add_argument("--seed", type=int, default=0, help="picks the random cut points")
    v.add_argument("--cut-at", metavar="STEPS", help="the steps to cut the split run at, e.g. 32,64 (default: the"
                                                     " first epoch ends, log and eval steps, and 3 random steps)")
    v.add_argument("--workdir", help="where both runs go (default: a new temporary folder)")
    v.set_defaults(func=commands.cmd_verify_resume)

    r = sub.add_parser("run", help="run the relay of a spec on Kaggle to the end (or one tick with --tick), on an"
                                    " embedded Prefect; stop it anywhere and run it again to continue")
    r.add_argument("spec", nargs="+", help="run spec YAML, relative to the current folder (paths inside it: to its"
                                            " folder); several: one account's relays sharing its session slots")
    r.add_argument("--out", metavar="DIR", help="where the session table, PNGs and Kaggle facts go (default:"
                                                " relay-runs/ beside the spec)")
    r.add_argument("--tick", action="store_true", help="do what needs no waiting (a hand-over, the next push) and return (cron, GitHub Actions)")
    r.add_argument("--poll", type=float, metavar="SECONDS",
                   help="seconds between status checks (default 30; 2 against the emulator)")
    r.add_argument("--submit", action="store_true",
                   help="run it on the Prefect server at PREFECT_API_URL (deployment relay/run, whose worker must see"
                        " the same paths) and follow it here")
    r.add_argument("--credentials-block", metavar="NAME", help=CREDENTIALS_BLOCK_HELP)
    r.set_defaults(func=commands.cmd_run)

    dr = sub.add_parser("doctor", help="check an account before spending GPU quota: credentials, quota, data"
                                       " sources, and a CPU canary kernel that starts as a session would")
    dr.add_argument("spec", nargs="?", help="run spec YAML (without it: credentials and quota only)")
    dr.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the canary kernel")
    dr.add_argument("--poll", type=float, default=5.0, help="seconds between its status checks")
    dr.add_argument("--probe", action="store_true", help="check what this account's Kaggle does against what the"
                    " relay depends on (a CPU kernel and a tiny private dataset, deleted after): a table of"
                    " expected vs seen, exit 1 on a difference")
    dr.add_argument("--report", metavar="PATH", help="with --probe: where its JSON report goes (default"
                    " relay-probe-<time>.json here), to attach to a bug report")
    dr.set_defaults(func=commands.cmd_doctor)

    it = sub.add_parser("init", help="make a repository relay itself: a spec skeleton for its entry and a GitHub"
                                     " Actions workflow that ticks it with a pinned kaggle-relay (writes only new files)")
    it.add_argument("path", nargs="?", default=".", help="the repository's root (default: the current folder)")
    it.add_argument("--entry", required=True, help="what a session runs: 'train.py --lr 3e-4', 'train.ipynb' or"
                                                   " 'module:function', relative to PATH")
    it.add_argument("--name", help="the relay's name (default: from the folder's name)")
    it.add_argument("--spec", default="spec.yaml", help="the spec to write, relative to PATH (default spec.yaml)")
    source = it.add_mutually_exclusive_group()
    source.add_argument("--wheel", metavar="FILE", help="install kaggle-relay from this wheel, copied to"
                                                        " .github/relay/ and checked by its sha256 (default: the"
                                                        " git commit of the kaggle-relay checkout running this,"
                                                        " from its remote)")
    source.add_argument("--git", metavar="URL[@REF]", help="install kaggle-relay from this git repository (REF"
                                                           " default: the tag vVERSION; a commit pins it for good)")
    it.set_defaults(func=commands.cmd_init)

    e = sub.add_parser("emulator", help="the local Kaggle API emulator (relay emulator serve --help)")
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(func=commands.cmd_emulator)
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
