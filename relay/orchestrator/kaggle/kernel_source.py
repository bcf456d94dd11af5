"""The source of a relay session kernel: one self-contained Python script.

The relay package is embedded base64 in the script rather than attached as a dataset: one SaveKernel call
ships code and run spec atomically (no extra dataset version to publish and wait for, no race between a code
dataset and the kernel), GetKernel returns exactly the code that ran, and the run id marker used to make
pushes idempotent lives in the same text. The bundle is small (the kernel side's .py files, deflated).
The script needs no internet: it extracts the bundle outside the working folder (so it is not output),
records the code version and run id in relay-kernel.json, writes the session's plan (PLAN: relay/shared/session_plan.py,
made once by session_plan() and embedded as its JSON) beside the spec and runs `python -m relay train --plan`,
forwarding SIGTERM. find_plan reads PLAN back by its keys (`relay status`, wedge deadlines, goodput), which the
plans pushed before it share.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import time
from typing import Optional

from relay.orchestrator.kaggle.bundle import Bundle
from relay.orchestrator.kaggle.types import SessionKernel
from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MARKER_FILE = "relay-kernel.json"


def run_id_marker(run_id: str) -> str:
    """The line that identifies the push of `run_id` inside a kernel's source."""
    return f"# relay-run-id: {run_id}\n"


_MARKER = re.compile(r"^# relay-run-id: (\S+)$", re.M)


def find_run_id(source: str) -> Optional[str]:
    """The run id a kernel source was pushed for (see run_id_marker), None if it carries none."""
    m = _MARKER.search(source or "")
    return m.group(1) if m else None


_PLAN = re.compile(r"^PLAN = (.+)$", re.M)


def find_plan(source: str) -> Optional[dict]:
    """The plan a relay kernel source was pushed with (run id, budget, mounts), None if it carries none."""
    m = _PLAN.search(source or "")
    try:
        return json.loads(ast.literal_eval(m.group(1))) if m else None
    except (ValueError, SyntaxError):
        return None


_SPEC = re.compile(r"^SPEC = (.+)$", re.M)


def find_spec(source: str) -> Optional[str]:
    """The run spec's YAML a relay kernel source was pushed with (the spec its session runs), None if none."""
    m = _SPEC.search(source or "")
    try:
        text = ast.literal_eval(m.group(1)) if m else None
    except (ValueError, SyntaxError):
        return None
    return text if isinstance(text, str) else None


def validate_run_id(run_id: str) -> None:
    if not RUN_ID_PATTERN.match(run_id or ""):
        raise InputError(f"run id {run_id!r}: use 1-64 letters, digits, '.', '_' or '-'")


def session_plan(session: SessionKernel, bundle: Bundle) -> SessionPlan:
    """The plan this push gives its session (relay/shared/session_plan.py), made once here."""
    return SessionPlan(
        run_id=session.run_id, budget=session.budget_s, workdir=session.workdir_name,
        resume=(session.checkpoint_dataset,) if session.checkpoint_dataset else (),
        data=session.data_dataset, features=tuple(session.features_datasets),
        code_version=bundle.code_version, bundle_sha256=hashlib.sha256(bundle.data).hexdigest(),
        spec_sha256=hashlib.sha256(session.spec_text.encode()).hexdigest(),
        user_code=bool(session.code_folder), pip=tuple(session.pip),
        canary=tuple(session.canary) if session.canary is not None else None,
        # when it was pushed (this machine's clock): output of another run soon after is Kaggle's status lag
        pushed_at=round(time.time(), 1),
        # the limit the push asks Kaggle for: a session still running well past it is wedged (handoff.observe)
        timeout_s=session.session_timeout_s,
        charges=tuple(dict(c) for c in session.charges))


def render(session: SessionKernel, bundle: Bundle) -> str:
    validate_run_id(session.run_id)
    plan = session_plan(session, bundle)
    encoded = base64.b64encode(bundle.data).decode("ascii")
    lines = [encoded[i:i + 100] for i in range(0, len(encoded), 100)]
    return (
        "# kaggle-relay session kernel (generated; do not edit)\n"
        + run_id_marker(session.run_id)
        + f"# relay-code-version: {bundle.code_version}\n"
        + f"PLAN = {plan.to_json()!r}\n"
        + f"SPEC = {session.spec_text!r}\n"
        + "BUNDLE = (\n" + "".join(f"    {line!r}\n" for line in lines) + ")\n"
        + _RUNNER
    )


_RUNNER = r'''
import base64, hashlib, io, json, os, signal, subprocess, sys, tempfile, time, zipfile


def main():
    plan = json.loads(PLAN)  # what this script itself needs of the plan; the session reads all of it (--plan)
    working = os.environ.get("KAGGLE_WORKING_DIR", "/kaggle/working")
    data = base64.b64decode("".join(BUNDLE))
    if hashlib.sha256(data).hexdigest() != plan["bundle_sha256"]:
        sys.exit("relay: embedded code bundle is corrupted")
    code_dir = tempfile.mkdtemp(prefix="relay-code-")
    zipfile.ZipFile(io.BytesIO(data)).extractall(code_dir)
    spec_path = os.path.join(code_dir, "run-spec.yaml")
    with open(spec_path, "w") as f:
        f.write(SPEC)
    workdir = os.path.join(working, plan["workdir"])
    os.makedirs(workdir, exist_ok=True)
    marker = {k: plan[k] for k in ("run_id", "code_version", "bundle_sha256")}
    marker["started"] = time.time()
    marker_path = os.path.join(working, "relay-kernel.json")

    def write_marker():
        with open(marker_path + ".tmp", "w") as f:
            json.dump(marker, f, indent=1)
        os.replace(marker_path + ".tmp", marker_path)

    write_marker()
    env = dict(os.environ)
    if plan.get("user_code"):  # the spec's code.folder, unpacked beside the package (relay/kernel/usercode.py)
        env["RELAY_CODE_DIR"] = os.path.join(code_dir, "user-code")
    if plan.get("pip"):
        print("relay: pip install", " ".join(plan["pip"]), flush=True)
        if subprocess.call([sys.executable, "-m", "pip", "install", "-q", *plan["pip"]]) != 0:
            print("relay: error: kaggle.pip: pip install failed (see the log above)", flush=True)
            sys.exit(2)
    # the session's plan as the orchestrator made it (relay/shared/session_plan.py); the session finds the mounts
    plan_path = os.path.join(code_dir, "session-plan.json")
    with open(plan_path, "w") as f:
        f.write(PLAN)
    cmd = [sys.executable, "-m", "relay", "train", spec_path, "--workdir", workdir, "--plan", plan_path]
    if plan["canary"] is not None:  # `relay doctor`: the same start, then checks (relay/kernel/canary.py)
        cmd = [sys.executable, "-m", "relay.kernel.canary", spec_path, "--out", os.path.join(workdir, "doctor.json"),
               "--plan", plan_path]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, env.get("PYTHONPATH")) if p)
    print("relay: code", plan["code_version"], "run", plan["run_id"], flush=True)
    child = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)  # the session saves and exits 0 on SIGTERM
    rc = child.wait()
    marker.update(exit_code=rc, ended=time.time())
    write_marker()
    sys.exit(rc)


main()
'''
