"""Seeded fault injection, so a failing test replays exactly.

Spec (JSON, or built from CLI flags):
  {"seed": 7,
   "methods": {"*": {"rate": 0.25},                        # any RPC or output download: 25 % faults
               "SaveKernel": {"script": ["lost", "ok"]},    # scripted first calls, then the rates
               "GetKernelSessionStatus": {"429": 0.1, "500": 0.1, "slow": 0.1, "slow_s": 0.5}},
   "upload_fail_midfile": 0.3,      # an upload PUT keeps only part of the bytes and answers 503
   "stale_output": true,            # after a failed run, output shows the previous successful run's files
   "kill_kernel": {"probability": 0.5, "min_s": 0.5, "max_s": 3},   # SIGKILL at a random instant
   "status_lag": {"seconds": 60, "calls": 5},   # after a push, unpinned status/output answer the previous version
   "latency": {"min_s": 0.01, "max_s": 0.1},     # every request waits a seeded draw, half before, half after
   "stream_drop": {"after_events": 20},         # each version's live log stream is cut once, after 20 events
   "version_refused": {"calls": 2},  # the 2 first new versions asked of a dataset after each version: 403
   "version_404": {"calls": 3},      # the 3 first reads naming a dataset's newest version number: 404
   "wedge": {"pushes": [2], "calls": 30},  # the 2nd session pushed stays RUNNING after its process ended
   "machine": {"pushes": [2], "gpus": ["Tesla P100-PCIE-16GB"], "image": "9f8e7d6"},  # what session 2 runs on
   "delete_lag": {"calls": 20},     # a deleted session holds its slot and is charged for 20 more calls (default)
   "dataset_failed": {"versions": [2], "slugs": ["-ckpt"]},  # 2nd version of each *-ckpt* dataset: FAILED
   "dataset_reprocessing": {"calls": 2}}  # each version reads REPROCESSING for 2 status polls after processing
Kinds: 429 (with Retry-After), 500, 503, reset (connection dropped before handling), lost (handled, then the
connection dropped: the client cannot know it happened), slow (answered after slow_s seconds), refused (HTTP 200
`{"versionNumber": 0, "error": ...}` without handling: a refused push; script it for SaveKernel), hang (never
answered: the request waits until the emulator stops), html (an HTML error page with status `html_status`,
default 503, and Retry-After when 429: what Kaggle's front end answers instead of JSON).
version_refused: Kaggle refuses a new dataset version (403) while the previous one still processes, and its
status can read READY before that ends; here the first `calls` CreateDatasetVersion requests after each new
version are refused whatever the status says. version_404: a new version 404s for a few seconds after its
creation; here the first `calls` requests naming the newest version's number (ListDatasetFiles, DownloadDataset,
its file GETs) answer 404. Both count calls, not seconds, so a test does not depend on the machine's speed.
status_lag: GetKernelSessionStatus and ListKernelSessionOutput without a versionLabel answer the previous
version while the newest was pushed less than `seconds` ago OR fewer than `calls` such calls have been
answered since its push (`calls` alone is independent of the machine's speed). With a versionLabel they
answer that version, as Kaggle does; with `"pinned": true` (the pessimistic reading: whether the lag reaches
pinned requests is undocumented) a versionLabel naming the newest version is answered with the previous one too.
wedge: Kaggle misses a session's end (a crash after its last save, a hung shutdown): the process of each session
pushed as the `pushes`-th GPU or CPU batch run of the emulator (1-based; absent: every one) ends, but its status
stays RUNNING, no output is served, and it keeps its concurrency slot and counts GPU time, past its own session
limit: until `calls` GetKernelSessionStatus calls were answered for it after that limit passed (then it reads
what its process ended with), or until its kernel is deleted (`calls` 0 or absent). Counted in calls, not
seconds, like the others.
machine: what the sessions pushed as the `pushes`-th batch runs (absent: every one) run on, other than asked
(Kaggle served a P100 for a T4 request; its image changes every few weeks): `image` becomes GIT_COMMIT in the
session's environment (how Kaggle's image names itself); `gpus` and the other keys a session records of its
runtime (`torch`, `cuda`, `cudnn`, `python`, `cpu`, `cpu_capability`, `gpu_capability`: relay/shared/runtime.py)
become RELAY_TEST_HARDWARE, which replaces what the session sees (CUDA and another CPU cannot run here).
delete_lag (on by default: {"calls": DEFAULT_DELETE_LAG_CALLS}; {"calls": 0} turns it off): Kaggle does not
free a deleted kernel's session at once. Its session count has gone on counting a killed or deleted kernel
("Maximum batch GPU session count of 2 reached" with fewer running: kaggle-cli #185), and a deleted notebook's
session has stayed "running" for a day (kaggle-cli #937, kaggle-benchmarks #89). Here each session running (or
wedged) when its kernel is deleted becomes a ghost: it holds its concurrency slot and is charged GPU time until
`calls` requests (RPCs) of its owner have been answered after the delete; counted in calls, not seconds.
dataset_failed: Kaggle's processing can end a version FAILED (kagglesdk datasets/types/dataset_enums.py,
DatabundleVersionStatus); here the `versions`-th version created of every dataset whose ref contains one of
`slugs` (absent: every dataset; 1-based, counted per dataset) ends FAILED once its processing polls are spent:
GetDatasetStatus answers FAILED, it is never mounted or made current, and a new version may be created over it.
dataset_reprocessing: the enum also names REPROCESSING (kagglesdk DatabundleVersionStatus; when Kaggle enters it is
undocumented); here every version, once its processing polls are spent, answers REPROCESSING to `calls` more
status polls and is not current meanwhile.
latency: each RPC, file GET and upload PUT is delayed by a draw from [min_s, max_s], half before it is handled
(the request's way in) and half after (the response's way out), so two orchestrators' check-then-act steps
interleave as they do over a real network.
Each decision draws from Random(f"{seed}/{key}/{n}"): the n-th call of a method gets the same fate whatever
other threads do.
"""
from __future__ import annotations

import json
import random
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Optional

from relay.shared.environment import HARDWARE
from relay.shared.errors import InputError
from relay.shared.runtime import RUNTIME_KEYS

DEFAULT_DELETE_LAG_CALLS = 20  # the relay's own requests after a delete: enough that its first push meets the ghost
KINDS = ("429", "500", "503", "reset", "lost", "slow", "refused", "hang", "html")
DEFAULT_RATE_KINDS = ("429", "500", "reset", "lost")


@dataclass(frozen=True)
class Fault:
    kind: str            # "ok" or one of KINDS
    slow_s: float = 0.0
    status: int = 503    # the HTTP status of an `html` fault


class FaultPlan:
    def __init__(self, spec: Optional[dict] = None):
        spec = dict(spec or {})
        self.seed = spec.get("seed", 0)
        self.methods: Dict[str, dict] = spec.get("methods", {})
        self.upload_fail_midfile = float(spec.get("upload_fail_midfile", 0.0))
        self.stale_output = bool(spec.get("stale_output", False))
        self.kill_kernel: Optional[dict] = spec.get("kill_kernel")
        self.status_lag: dict = dict(spec.get("status_lag") or {})
        unknown = set(self.status_lag) - {"seconds", "calls", "pinned"}
        if unknown:
            raise InputError(f"faults: status_lag: unknown keys {sorted(unknown)} (use seconds, calls, pinned)")
        self.lag_pinned = bool(self.status_lag.pop("pinned", False))
        self.latency: dict = dict(spec.get("latency") or {})
        unknown = set(self.latency) - {"min_s", "max_s"}
        if unknown:
            raise InputError(f"faults: latency: unknown keys {sorted(unknown)} (use min_s, max_s)")
        if not 0 <= float(self.latency.get("min_s", 0)) <= float(self.latency.get("max_s", 0)) or \
                float(self.latency.get("max_s", 0)) > 60:
            raise InputError("faults: latency: need 0 <= min_s <= max_s <= 60")
        self.stream_drop: dict = dict(spec.get("stream_drop") or {})
        self.version_refused = self._calls_setting(spec, "version_refused")
        self.version_404 = self._calls_setting(spec, "version_404")
        self.wedge: Optional[dict] = self._wedge_setting(spec.get("wedge"))
        self.machine: Optional[dict] = self._machine_setting(spec.get("machine"))
        self.delete_lag = self._calls_setting({"delete_lag": spec.get("delete_lag", {"calls": DEFAULT_DELETE_LAG_CALLS})},
                                              "delete_lag")
        self.dataset_failed = self._versions_setting(spec.get("dataset_failed"))
        self.dataset_reprocessing = self._calls_setting(spec, "dataset_reprocessing")
        self._pushes = 0
        self._streams_cut: set = set()
        self._lagged: Dict[str, int] = defaultdict(int)  # kernel version -> unpinned calls answered since push
        self._counts: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.injected: Dict[str, int] = defaultdict(int)  # kind -> count, for tests and logs
        for name, rule in self.methods.items():
            for kind in rule.get("script", []):
                if kind != "ok" and kind not in KINDS:
                    raise InputError(f"faults: method {name}: unknown kind {kind!r} (use ok or {', '.join(KINDS)})")

    @staticmethod
    def _calls_setting(spec: dict, key: str) -> int:
        value = spec.get(key) or {}
        if set(value) - {"calls"} or not isinstance(value.get("calls", 0), int) or value.get("calls", 0) < 0:
            raise InputError(f"faults: {key}: expected {{\"calls\": N}} with N >= 0 (got {value!r})")
        return int(value.get("calls", 0))

    @staticmethod
    def _versions_setting(value: Optional[dict]) -> dict:
        if value is None:
            return {"versions": [], "slugs": None}
        ok = isinstance(value, dict) and not set(value) - {"versions", "slugs"}
        versions, slugs = (value.get("versions"), value.get("slugs")) if ok else (None, None)
        if not isinstance(versions, list) or not all(isinstance(n, int) and n >= 1 for n in versions) or \
                not (slugs is None or (isinstance(slugs, list) and all(isinstance(x, str) for x in slugs))):
            raise InputError("faults: dataset_failed: expected {\"versions\": [N, ...], \"slugs\": [text, ...]} with"
                             f" N >= 1, slugs optional (got {value!r})")
        return {"versions": list(versions), "slugs": slugs}

    def fails_processing(self, dataset_ref: str, version: int) -> bool:
        """Whether version `version` of `dataset_ref` ends FAILED (dataset_failed)."""
        rule = self.dataset_failed
        failed = version in rule["versions"] and (rule["slugs"] is None or any(s in dataset_ref for s in rule["slugs"]))
        if failed:
            with self._lock:
                self.injected["dataset_failed"] += 1
        return failed

    def ghost_refused(self) -> None:
        """A push refused because a deleted session still held its slot (delete_lag), counted for tests."""
        with self._lock:
            self.injected["delete_lag_refusal"] += 1

    @staticmethod
    def _wedge_setting(value: Optional[dict]) -> Optional[dict]:
        if value is None:
            return None
        valid = isinstance(value, dict) and not set(value) - {"pushes", "calls"}
        calls, pushes = (value.get("calls", 0), value.get("pushes")) if valid else (None, None)
        valid = valid and isinstance(calls, int) and calls >= 0 and _pushes_ok(pushes)
        if not valid:
            raise InputError(f"faults: wedge: expected {{\"pushes\": [N, ...], \"calls\": M}} with N >= 1 and"
                             f" M >= 0 (got {value!r})")
        return {"pushes": pushes, "calls": calls}

    @staticmethod
    def _machine_setting(value: Optional[dict]) -> Optional[dict]:
        if value is None:
            return None
        told = {k: v for k, v in value.items() if k != "pushes"} if isinstance(value, dict) else {}
        pushes = value.get("pushes") if isinstance(value, dict) else None
        if not told or set(told) - {"gpus", *RUNTIME_KEYS} or not _pushes_ok(pushes) or \
                not isinstance(told.get("gpus", []), list):
            raise InputError("faults: machine: expected {\"pushes\": [N, ...], and any of \"gpus\": [names], "
                             + ", ".join(f'"{k}"' for k in RUNTIME_KEYS) + f"}} (got {value!r})")
        return {"pushes": pushes, "told": told}

    def next_push(self) -> int:
        """The ordinal (1-based) of the batch run being pushed now: the `wedge` and `machine` faults name them."""
        with self._lock:
            self._pushes += 1
            return self._pushes

    def wedges(self, push: int) -> bool:
        """Whether the `push`-th batch run is one the `wedge` fault wedges."""
        wedged = self.wedge is not None and (self.wedge["pushes"] is None or push in self.wedge["pushes"])
        if wedged:
            with self._lock:
                self.injected["wedge"] += 1
        return wedged

    def machine_env(self, push: int) -> dict:
        """The environment the `push`-th batch run gets from the `machine` fault ({} when it does not apply)."""
        rule = self.machine
        if rule is None or (rule["pushes"] is not None and push not in rule["pushes"]):
            return {}
        with self._lock:
            self.injected["machine"] += 1
        told = dict(rule["told"])
        env = {"GIT_COMMIT": str(told.pop("image"))} if "image" in told else {}
        return {**env, **({HARDWARE: json.dumps(told)} if told else {})}

    def still_wedged(self, version_key: str) -> bool:
        """Whether this status call of a wedged version (`version_key`: unique to it, even across a deleted and
        re-created kernel), past its session limit, still answers RUNNING."""
        calls = self.wedge["calls"] if self.wedge else 0
        return calls == 0 or self._within_calls(calls, f"wedge/{version_key}", "wedge_call")

    def _rng(self, *key: object) -> random.Random:
        return random.Random("/".join(str(k) for k in (self.seed,) + key))

    def decide(self, method: str) -> Fault:
        rule = self.methods.get(method, self.methods.get("*"))
        if not rule:
            return Fault("ok")
        with self._lock:
            n = self._counts[method]
            self._counts[method] += 1
        script = rule.get("script", [])
        if n < len(script):
            kind = script[n]
        else:
            kind = self._draw(rule, self._rng(method, n).random())
        if kind != "ok":
            with self._lock:
                self.injected[kind] += 1
        status = int(rule.get("html_status", 503))
        if not 400 <= status <= 599:
            raise InputError(f"faults: method {method}: html_status {status}: expected an HTTP error status (4xx, 5xx)")
        return Fault(kind, float(rule.get("slow_s", 0.3)) if kind == "slow" else 0.0, status)

    @staticmethod
    def _draw(rule: dict, u: float) -> str:
        if "rate" in rule:
            kinds = rule.get("kinds", DEFAULT_RATE_KINDS)
            share = float(rule["rate"]) / len(kinds)
            weights = {k: share for k in kinds}
        else:
            weights = {k: float(rule[k]) for k in KINDS if k in rule}
        edge = 0.0
        for kind, weight in weights.items():
            edge += weight
            if u < edge:
                return kind
        return "ok"

    def delay(self, key: str) -> tuple:
        """(seconds before handling, seconds after) for one request to `key` (latency)."""
        if not self.latency:
            return 0.0, 0.0
        with self._lock:
            n = self._counts["latency/" + key]
            self._counts["latency/" + key] += 1
        rng = self._rng("latency", key, n)
        total = rng.uniform(float(self.latency.get("min_s", 0)), float(self.latency["max_s"]))
        before = total * rng.random()
        return before, total - before

    def upload_cut(self, token: str, attempt: int, size: int) -> Optional[int]:
        """How many bytes of this PUT to keep before failing it, or None to let it through."""
        if size < 2 or self.upload_fail_midfile <= 0:
            return None
        rng = self._rng("upload", token, attempt)
        if rng.random() >= self.upload_fail_midfile:
            return None
        with self._lock:
            self.injected["upload_midfile"] += 1
        return max(1, min(size - 1, int(size * rng.uniform(0.1, 0.9))))

    def lagging(self, kernel_ref: str, version: int, pushed: float, now: float) -> bool:
        """Whether an unpinned status/output call now answers the version before `version` (status_lag)."""
        if not self.status_lag:
            return False
        key = f"{kernel_ref}/v{version}"
        with self._lock:
            calls = self._lagged[key]
            self._lagged[key] += 1
        lag = (now - pushed < float(self.status_lag.get("seconds", 0))
               or calls < int(self.status_lag.get("calls", 0)))
        if lag:
            with self._lock:
                self.injected["status_lag"] += 1
        return lag

    def stream_cut(self, kernel_ref: str, version: int) -> Optional[int]:
        """After how many events to cut this connection of a live log stream (once per version), or None."""
        if not self.stream_drop:
            return None
        with self._lock:
            if (kernel_ref, version) in self._streams_cut:
                return None
            self._streams_cut.add((kernel_ref, version))
            self.injected["stream_drop"] += 1
        return int(self.stream_drop.get("after_events", 10))

    def refuse_version(self, dataset_ref: str, after_version: int) -> bool:
        """Whether this request for a new version of `dataset_ref`, whose newest is `after_version`, is refused
        as if that version were still processing (version_refused)."""
        return self._within_calls(self.version_refused, f"refuse/{dataset_ref}/{after_version}", "version_refused")

    def hide_version(self, dataset_ref: str, version: int) -> bool:
        """Whether this read naming `version`, the newest of `dataset_ref`, answers 404 (version_404)."""
        return self._within_calls(self.version_404, f"hide/{dataset_ref}/{version}", "version_404")

    def _within_calls(self, calls: int, key: str, kind: str) -> bool:
        if calls <= 0:
            return False
        with self._lock:
            n = self._counts[key]
            self._counts[key] += 1
            if n < calls:
                self.injected[kind] += 1
        return n < calls

    def kill_at(self, kernel_ref: str, version: int) -> Optional[float]:
        """Wall seconds after start at which to SIGKILL this kernel version, or None."""
        spec = self.kill_kernel
        if not spec:
            return None
        rng = self._rng("kill", kernel_ref, version)
        if rng.random() >= float(spec.get("probability", 1.0)):
            return None
        return rng.uniform(float(spec.get("min_s", 0.0)), float(spec.get("max_s", 1.0)))


def _pushes_ok(pushes: object) -> bool:
    return pushes is None or (isinstance(pushes, list) and all(isinstance(n, int) and n >= 1 for n in pushes))


def from_flags(rate: float = 0.0, seed: int = 0, kinds: Optional[list] = None) -> dict:
    spec: dict = {"seed": seed, "methods": {}}
    if rate > 0:
        spec["methods"]["*"] = {"rate": rate, "kinds": list(kinds or DEFAULT_RATE_KINDS)}
    return spec
