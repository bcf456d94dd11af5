"""`relay doctor [SPEC]`: the first contact with an account, before any GPU quota is spent.

One line per check, each failure saying what to do: the credentials (and where they were found), the API and
the account's GPU quota, the spec with the user's code, the data sources, then a short CPU canary kernel (no
GPU quota) that starts as a session does (the shipped bundle, the user's code, every mount at the path the
spec expects), runs the checks of relay/kernel/canary.py instead of training, and is read back from its output.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Callable, Iterator, Optional

from relay.shared.errors import InputError

OK, FAIL, INFO = "ok", "FAIL", "info"


@dataclass(frozen=True)
class Check:
    status: str   # ok | FAIL | info
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<16} {self.detail}"


def run(spec_path: Optional[str], backend_factory: Callable, timeout_s: float = 900.0,
        poll_s: float = 5.0, emit: Callable[[str], None] = print) -> int:
    """Print every check as it completes; 0 when none failed, 1 otherwise (2, via InputError, on a bad spec
    path)."""
    failed = 0
    for check in _checks(spec_path, backend_factory, timeout_s, poll_s):
        emit(check.line())
        failed += check.status == FAIL
    emit("all checks passed: `relay run` is ready" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


def _checks(spec_path, backend_factory, timeout_s, poll_s) -> Iterator[Check]:
    from relay.orchestrator.kaggle import KaggleError, KaggleUnresponsive
    from relay.orchestrator.kaggle.credentials import resolve

    run_spec, spec_text = None, None
    if spec_path is not None:
        if not Path(spec_path).is_file():
            raise InputError(f"{spec_path}: no such spec file (relative paths start at {Path.cwd()})")
        from relay.front_door import read_spec

        try:
            loaded = read_spec(spec_path)  # the spec checked and the text the canary ships: one read
            run_spec, spec_text = loaded.spec, loaded.text
            yield Check(OK, "spec", f"{spec_path}: {run_spec.name}, the code validates on this machine")
        except InputError as err:
            yield Check(FAIL, "spec", f"{err} -> fix the spec, then run relay doctor again")
    try:
        creds = resolve()
        yield Check(OK, "credentials", f"user {creds.username}, from {creds.source}")
    except InputError as err:
        yield Check(FAIL, "credentials", f"{err} -> create a token at kaggle.com > Settings > API and save it"
                                         " as ~/.kaggle/access_token with KAGGLE_USERNAME set, or a legacy key as"
                                         " ~/.kaggle/kaggle.json (chmod 600)")
        return
    try:
        backend = backend_factory()
        quota = backend.quota()
    except KaggleUnresponsive as err:
        yield Check(FAIL, "api", f"{err} -> Kaggle is not answering; try again later")
        return
    except KaggleError as err:
        yield Check(FAIL, "api", f"{err} -> check the key (it may be revoked) and the network")
        return
    yield _quota_check(quota)
    if run_spec is None:
        yield Check(INFO, "canary", "no spec given: pass one to check its data sources and code inside Kaggle")
        return
    sources = list(_source_checks(backend, run_spec))
    yield from sources
    if any(c.status == FAIL for c in sources):  # Kaggle refuses a push that names a missing source
        yield Check(INFO, "canary kernel", "not pushed: fix the data sources first")
        return
    if run_spec.kaggle.enable_internet or run_spec.kaggle.pip:
        yield Check(INFO, "internet", "kaggle.enable_internet needs a phone-verified account (not readable"
                                      " through the API): the canary below proves it works")
    yield from _canary(backend, run_spec, spec_text, timeout_s, poll_s)


def _quota_check(quota) -> Check:
    refresh = quota.refresh_time
    when = f"; refreshes {refresh.astimezone(timezone.utc):%Y-%m-%d %H:%M} UTC" if refresh else ""
    if quota.allowed_s <= 0:
        return Check(FAIL, "gpu quota", "the account has no GPU quota -> verify its phone number at kaggle.com >"
                                        " Settings (GPUs need it), then run relay doctor again")
    left_h = quota.remaining_s / 3600
    status = OK if quota.remaining_s > 0 else INFO
    return Check(status, "gpu quota", f"{left_h:.1f} of {quota.allowed_s / 3600:.1f} h left this week{when}"
                 + ("" if quota.remaining_s > 0 else " (a relay waits for the refresh)"))


def _source_checks(backend, run_spec) -> Iterator[Check]:
    from relay.orchestrator.kaggle import KaggleError, NotFound

    for ref in run_spec.kaggle.dataset_sources:
        try:
            files = backend.list_dataset_files(ref)
            yield Check(OK if files else FAIL, "data source",
                        f"{ref}: {len(files)} files" if files else f"{ref}: empty -> upload its files")
        except NotFound:
            yield Check(FAIL, "data source", f"{ref}: not found or not readable by this account -> check the"
                                             " slug, or share the dataset with this account")
        except KaggleError as err:
            yield Check(FAIL, "data source", f"{ref}: {err}")


def _canary(backend, run_spec, spec_text: str, timeout_s: float, poll_s: float) -> Iterator[Check]:
    import json

    from relay.orchestrator.handoff import log_tail
    from relay.orchestrator.kaggle import KaggleError
    from relay.orchestrator.kaggle.types import SessionKernel

    k = run_spec.kaggle
    mounts = tuple(k.dataset_sources) + tuple(f"competitions/{c}" for c in k.competition_sources)
    kernel = SessionKernel(
        kernel=f"{backend.username}/{run_spec.name}-doctor", title=f"{run_spec.name} doctor",
        spec_text=spec_text, run_id=f"doctor-{int(time.time())}", extra_datasets=tuple(k.dataset_sources),
        competitions=tuple(k.competition_sources), enable_gpu=False, enable_internet=k.enable_internet,
        machine_shape=None, code_folder=run_spec.code.folder if run_spec.code else None,
        code_exclude=tuple(run_spec.code.exclude) if run_spec.code else (), pip=tuple(k.pip), canary=mounts)
    try:
        pushed = backend.push_session(kernel)
        if not pushed.pushed:
            yield Check(FAIL, "canary kernel", f"push refused: {pushed.message} -> wait, then run relay doctor again")
            return
        state = _wait(backend, kernel.kernel, pushed.version, timeout_s, poll_s)
        with tempfile.TemporaryDirectory(prefix="relay-doctor-") as tmp:
            out = backend.download_output(kernel.kernel, Path(tmp) / "out", kernel.run_id, version=pushed.version)
            report_path = out.directory / "relay" / "doctor.json"
            tail = log_tail(out.log_path, lines=15)
            report = json.loads(report_path.read_text()) if report_path.is_file() else None
    except KaggleError as err:
        yield Check(FAIL, "canary kernel", f"{err}")
        return
    if report is None:
        yield Check(FAIL, "canary kernel", f"{kernel.kernel} v{pushed.version} ended {state} without its report"
                                           f" -> its log:\n{tail}")
        return
    yield Check(OK, "canary kernel", f"{kernel.kernel} v{pushed.version} ran on CPU (no GPU quota) with code"
                                     f" {report['code_version']}; its output was read back")
    for c in report["checks"]:
        yield Check(OK if c["ok"] else FAIL, f"  {c['name']}", c["detail"])


def _wait(backend, kernel: str, version: Optional[int], timeout_s: float, poll_s: float) -> str:
    from relay.orchestrator.kaggle import KaggleError, NotFound

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = backend.kernel_status(kernel, version)
            if status.state.finished:
                return status.state.value
        except NotFound:
            pass  # right after a push the version may not be visible yet
        if time.monotonic() > deadline:
            raise KaggleError(f"{kernel} v{version} did not finish within {timeout_s:.0f} s -> see it on"
                              " kaggle.com, or raise --timeout")
        time.sleep(poll_s)
