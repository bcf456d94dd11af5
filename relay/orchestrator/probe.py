"""`relay doctor --probe`: what the user's own Kaggle account does, checked against what the relay depends on.

With a CPU kernel (no GPU quota) and a tiny private dataset it looks at each behaviour the relay builds on (the
table in docs/kaggle.md, "Where the emulator holds to Kaggle"): how an absent kernel answers, the slug a title
gives, the status values through a run, how a past version is addressed, the quota report, the processing of a
small dataset version, and what deleting a running kernel leaves behind. It prints one row per behaviour,
expected vs seen, one line per difference, writes them to a JSON file to attach to a bug report, and deletes
its kernel and dataset. Where Kaggle's documented behaviour is a range (a delete's lag, processing time), a row
accepts the range. The exit status is 1 when a row differs.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from relay.orchestrator.kaggle import kernel_lookup
from relay.orchestrator.kaggle.retry import http_status

QUICK = "# relay-probe {n}\nprint('relay probe version {n}')\n"
# a version that runs until deleted (bounded, should the delete not come: a CPU session costs no GPU quota)
RUNS_ON = "# relay-probe {n}\nimport time\nend = time.time() + 600\nwhile time.time() < end:\n    time.sleep(0.5)\n"


@dataclass
class Row:
    behaviour: str
    expected: str
    seen: str
    ok: bool

    def line(self) -> str:
        return f"{'ok' if self.ok else 'DIFF':<5} {self.behaviour:<26} expected: {self.expected} | seen: {self.seen}"


class Probe:
    def __init__(self, backend: Any, stamp: Optional[str] = None, timeout_s: float = 900.0, poll_s: float = 5.0):
        self.backend, self.timeout_s, self.poll_s = backend, timeout_s, poll_s
        self.owner = backend.username
        self.stamp = stamp or str(int(time.time()))
        self.title = f"relay probe {self.stamp}"
        self.kernel = f"{self.owner}/relay-probe-{self.stamp}"          # the slug its title gives
        self.asked = f"{self.owner}/relay-probe-{self.stamp}-asked"     # the slug its first push names
        self.dataset = f"{self.owner}/relay-probe-{self.stamp}-data"
        self.rows: List[Row] = []

    # -- the wire, as the relay sends it ---------------------------------------------------------
    def _get(self, slug: str, label: Optional[str] = None) -> Any:
        """GetKernel's answer, or the HTTP status it failed with."""
        def get(kaggle: Any) -> Any:
            from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

            request = ApiGetKernelRequest()
            request.user_name, request.kernel_slug = self.owner, slug
            if label is not None:
                request.version_label = label
            return kaggle.kernels.kernels_api_client.get_kernel(request)

        try:
            return self.backend.client.sdk(f"get kernel {self.owner}/{slug}", get)
        except Exception as exc:  # noqa: BLE001 - the status is what is probed
            status = http_status(exc)
            if status is None:
                raise
            return status

    def _push(self, kernel: str, source: str) -> Any:
        folder = Path(tempfile.mkdtemp(prefix="relay-probe-"))
        try:
            (folder / "probe.py").write_text(source)
            (folder / "kernel-metadata.json").write_text(json.dumps({
                "id": kernel, "title": self.title, "code_file": "probe.py", "language": "python",
                "kernel_type": "script", "is_private": True, "enable_gpu": False, "enable_tpu": False,
                "enable_internet": False, "dataset_sources": [], "kernel_sources": [], "competition_sources": []}))
            with contextlib.redirect_stdout(io.StringIO()):  # the client prints its slug warning (the probe's point)
                return self.backend.client.run(f"push {kernel}", lambda api: api.kernels_push(str(folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _states(self, version: int, until: Callable[[str], bool]) -> List[str]:
        """The states version `version` of the probe kernel reads, each once in order, until `until` holds."""
        from relay.orchestrator.kaggle import NotFound

        seen: List[str] = []
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                state = self.backend.kernel_status(self.kernel, version).state.value
                seen += [state] if not seen or seen[-1] != state else []
                if until(state):
                    return seen
            except NotFound:
                pass  # right after a push the version may not be visible yet
            if time.monotonic() > deadline:
                return seen + [f"(no end within {self.timeout_s:g} s)"]
            time.sleep(self.poll_s)

    def _row(self, behaviour: str, expected: str, check: Callable[[], tuple]) -> None:
        try:
            seen, ok = check()
        except Exception as exc:  # noqa: BLE001 - a probe that fails is a difference to report, not a crash
            seen, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", False
        self.rows.append(Row(behaviour, expected, seen, ok))

    # -- the rows --------------------------------------------------------------------------------
    def run(self) -> List[Row]:
        try:
            self._row("absent kernel", "403 (kaggle-cli PR #951); 404 also handled", self._absent)
            self._row("slug of a pushed title", f"{self.kernel} (slugified title)", self._slug)
            self._row("status through a run", "queued/running -> complete", self._run_states)
            self._row("version addressing", "v1: version 1; slug/1: 403; '1': 404 (PR #1201)", self._versions)
            self._row("quota report", "allowed > 0, used and reserved >= 0, a refresh time", self._quota)
            self._row("small dataset version", "ready within the publisher's wait", self._dataset_version)
            self._row("delete of a running kernel", "it is gone; a push right after is accepted, or refused"
                      " for a while (kaggle-cli #185)", self._delete)
        finally:
            self._row("cleanup", "probe kernel and dataset deleted", self._cleanup)
        return self.rows

    def _absent(self) -> tuple:
        answer = self._get(self.kernel.split("/")[1])
        seen = str(answer) if isinstance(answer, int) else "a kernel (not absent)"
        return seen, answer in (403, 404)

    def _slug(self) -> tuple:
        response = self._push(self.asked, QUICK.format(n=1))
        if getattr(response, "error", None):
            return f"push refused: {response.error}", False
        landed = kernel_lookup.landed_ref(getattr(response, "ref", "") or "")
        return f"{landed} (version {response.version_number})", landed == self.kernel

    def _run_states(self) -> tuple:
        states = self._states(1, lambda s: s not in ("queued", "running"))
        return " -> ".join(states), states[-1:] == ["complete"] and set(states) <= {"queued", "running", "complete"}

    def _versions(self) -> tuple:
        response = self._push(self.kernel, QUICK.format(n=2))
        if getattr(response, "error", None) or response.version_number != 2:
            return f"a second version was not pushed: {response.error or response.version_number}", False
        self._states(2, lambda s: s not in ("queued", "running"))
        slug = self.kernel.split("/")[1]
        labelled, suffixed, bare = self._get(slug, "v1"), self._get(f"{slug}/1"), self._get(slug, "1")
        first = not isinstance(labelled, int) and "relay-probe 1" in (labelled.blob.source or "")
        said = lambda answer: str(answer) if isinstance(answer, int) else "a kernel"  # noqa: E731
        seen = f"v1: {'version 1' if first else said(labelled)}; slug/1: {said(suffixed)}; '1': {said(bare)}"
        return seen, first and suffixed == 403 and bare == 404

    def _quota(self) -> tuple:
        q = self.backend.quota()
        seen = (f"used {q.used_s / 3600:.2f} h, reserved {q.reserved_s / 3600:.2f} h of {q.allowed_s / 3600:.1f} h;"
                f" refresh {q.refresh_time.isoformat() if q.refresh_time else 'none'}")
        return seen, q.allowed_s > 0 and q.used_s >= 0 and q.reserved_s >= 0 and q.refresh_time is not None

    def _dataset_version(self) -> tuple:
        folder = Path(tempfile.mkdtemp(prefix="relay-probe-data-"))
        try:
            (folder / "probe.txt").write_text(f"relay probe {self.stamp}\n")
            started = time.monotonic()
            result = self.backend.publish_folder(folder, self.dataset, f"relay probe data {self.stamp}")
            return f"version {result.version} ready after {time.monotonic() - started:.1f} s", True
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _delete(self) -> tuple:
        from relay.orchestrator.kaggle import NotFound

        response = self._push(self.kernel, RUNS_ON.format(n=3))
        if getattr(response, "error", None):
            return f"push refused: {response.error}", False
        states = self._states(3, lambda s: s != "queued")
        if states[-1:] != ["running"]:
            return f"version 3 never ran: {' -> '.join(states)}", False
        self.backend.delete_kernel(self.kernel)
        try:
            after = f"status {self.backend.kernel_status(self.kernel, 3).state.value} after the delete"
            gone = False
        except NotFound:
            after, gone = "gone", True
        again = self._push(self.kernel, QUICK.format(n=4))
        pushed = f"accepted as version {again.version_number}" if not again.error else f"refused: {again.error}"
        return f"{after}; a push right after: {pushed}", gone

    def _cleanup(self) -> tuple:
        owner, slug = self.dataset.split("/")
        deletes = [(ref, lambda ref=ref: self.backend.delete_kernel(ref)) for ref in (self.kernel, self.asked)]
        deletes.append((self.dataset, lambda: self.backend.client.run(
            f"delete dataset {self.dataset}", lambda api: api.dataset_delete(owner, slug, no_confirm=True))))
        deleted, failed = [], []
        for ref, delete in deletes:
            try:
                deleted += [ref] if delete() else []
            except Exception as exc:  # noqa: BLE001 - absent (403/404: never made) is fine; anything else is said
                failed += [] if http_status(exc) in (403, 404) else [f"{ref}: {str(exc).splitlines()[0]}"]
        seen = f"deleted {', '.join(deleted) or 'nothing'}" + (f"; failed: {'; '.join(failed)}" if failed else "")
        return seen, not failed and self.kernel in deleted and self.dataset in deleted


def probe(backend: Any, report: Optional[Path] = None, emit: Callable[[str], None] = print,
          timeout_s: float = 900.0, poll_s: float = 5.0, stamp: Optional[str] = None) -> int:
    """Run every row, print the table and one line per difference, write the JSON report; 1 on a difference."""
    runner = Probe(backend, stamp, timeout_s, poll_s)
    emit(f"relay doctor --probe: {runner.kernel} and {runner.dataset} on {backend.endpoint or 'kaggle.com'}"
         " (a CPU kernel: no GPU quota)")
    rows = runner.run()
    for row in rows:
        emit(row.line())
    differences = [r for r in rows if not r.ok]
    for row in differences:
        emit(f"difference: {row.behaviour}: expected {row.expected}; seen {row.seen}")
    path = Path(report or f"relay-probe-{runner.stamp}.json")
    path.write_text(json.dumps({"user": runner.owner, "endpoint": backend.endpoint or "kaggle.com",
                                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "client": _versions(), "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    emit(f"{len(differences)} difference(s)" + (": attach " if differences else "; the report: ") + str(path))
    return 1 if differences else 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("kaggle", "kagglesdk", "kaggle-relay"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found
