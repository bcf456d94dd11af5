"""kernels.KernelsApiService: push (SaveKernel), status, output (paged, with log), pull (GetKernel), list,
delete (DeleteKernel), accelerator quota, and the files and log stream behind them."""
from __future__ import annotations

import json
import secrets
import shutil
import time
import urllib.parse
from typing import Iterator, Optional

from relay.emulator import kernel_rules
from relay.emulator.config import EmulatorConfig
from relay.emulator.faults import FaultPlan
from relay.emulator.protocol import ApiError, Call, duration, file_reply, iso, slug_of, tree_files
from relay.emulator.runner import KernelRunner, read_log
from relay.emulator.store import ACTIVE, Store
from relay.shared.environment import HARDWARE


CONCURRENCY_REFUSAL = "Maximum batch GPU session count of {n} reached."
QUOTA_REFUSAL = ("Accelerator Quota Exceeded: You've exceeded the number of hours allowed to use GPU. "
                 "Your quota will reset at {when}. You will not be able to commit unless you turn off GPU.")
META_FIELDS = ("language", "kernelType", "isPrivate", "enableGpu", "enableTpu", "enableInternet", "categoryIds",
               "datasetDataSources", "kernelDataSources", "competitionDataSources", "modelDataSources",
               "dockerImage", "machineShape")


class _TitleInUse(Exception):
    pass


class KernelsService:
    def __init__(self, store: Store, config: EmulatorConfig, faults: FaultPlan, runner: KernelRunner):
        self.store, self.config, self.faults, self.runner = store, config, faults, runner

    # -- SaveKernel ------------------------------------------------------------------------------
    def SaveKernel(self, call: Call) -> dict:
        body = call.body
        title = body.get("newTitle") or ""
        if title and len(title) < 5:
            return {"error": "Title must be at least five characters"}
        language, kernel_type = body.get("language") or "python", body.get("kernelType") or "script"
        if language != "python":
            return {"error": f"The emulator runs python kernels only (got {language})"}
        shape, refusal = kernel_rules.served_shape(body.get("machineShape"), bool(body.get("enableGpu")),
                                                   bool(body.get("enableTpu")))
        if refusal:
            return {"error": refusal}
        text = body.get("text") or ""
        source = notebook_to_script(text) if kernel_type == "notebook" else text
        quick = str(body.get("kernelExecutionType", "")).upper() in ("QUICK_SAVE", "3")
        gpu = kernel_rules.is_gpu(shape)  # a retired TPU shape runs on CPU (kernel_rules.RETIRED)
        now = time.time()
        with self.store.lock:
            try:
                ref = self._ref_for_save(call, title)
            except _TitleInUse:
                return {"error": kernel_rules.title_in_use(title)}
            owner, slug = ref.split("/", 1)
            if owner != call.user:
                raise ApiError(403, f"Permission denied: {call.user} cannot push to {owner}'s kernels")
            title = title or slug
            if any(k["title"] == title for r, k in self.store.kernels.items() if r != ref and k["owner"] == owner):
                return {"error": kernel_rules.title_in_use(title)}
            sources, invalid = self._resolve_sources(body, now)
            if invalid["datasets"] or invalid["kernels"]:
                return {"error": "Some data sources are missing or not ready",
                        "invalidDatasetSources": invalid["datasets"], "invalidKernelSources": invalid["kernels"]}
            if gpu and not quick:
                refusal = self._refusal(owner, now)
                if refusal:
                    return {"error": refusal}
            kernel = self.store.kernels.get(ref)
            if kernel is None:
                kernel = {"id": self.store.new_id(), "owner": owner, "slug": slug, "versions": []}
                self.store.kernels[ref] = kernel
            kernel["title"] = title
            number = len(kernel["versions"]) + 1
            requested = body.get("sessionTimeoutSeconds") or self.config.session_timeout_s
            version = {"number": number, "status": "NEW_SCRIPT" if quick else "QUEUED", "failure": "",
                       "pushed": now, "enable_gpu": gpu, "enable_internet": body.get("enableInternet", True),
                       "timeout_s": min(float(requested), self.config.session_timeout_s), "sources": sources,
                       "meta": {k: body[k] for k in META_FIELDS if k in body}, "output_key": secrets.token_hex(12),
                       "served_shape": shape, **self._faults_of_push(quick)}
            if shape != body.get("machineShape") and shape in kernel_rules.SEEN_GPUS and not version["env"]:
                # what a session on a substituted shape sees (the `machine` fault, when it applies, wins)
                version["env"] = {HARDWARE: json.dumps({"gpus": kernel_rules.SEEN_GPUS[shape]})}
            directory = self.store.kernel_dir(ref, number)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "source.py").write_text(source)
            (directory / "pushed.txt").write_text(text) if kernel_type == "notebook" else None
            kernel["versions"].append(version)
            self.store.save()
        if not quick:
            self.runner.start(ref, number)
        return {"ref": f"/code/{ref}", "url": f"{call.base}/code/{ref}", "versionNumber": number,
                "kernelId": kernel["id"]}

    def _faults_of_push(self, quick: bool) -> dict:
        """A batch run's share of the `wedge` and `machine` faults (they name runs by their push's ordinal)."""
        if quick:
            return {"wedge": False, "env": {}}
        push = self.faults.next_push()
        return {"wedge": self.faults.wedges(push), "env": self.faults.machine_env(push)}

    def _ref_for_save(self, call: Call, title: str) -> str:
        """The kernel a push lands on: the one its slug (or id) names if that exists; a new kernel takes its slug
        from the title (kernel_rules.slug_from_title), whatever slug was asked for."""
        if call.body.get("slug"):
            ref = str(call.body["slug"])
            ref = ref if "/" in ref else f"{call.user}/{ref}"
            if ref in self.store.kernels or not title:
                return ref
            derived = f"{ref.split('/', 1)[0]}/{kernel_rules.slug_from_title(title)}"
            if derived != ref and derived in self.store.kernels:  # the title is another kernel's
                raise _TitleInUse(title)
            return derived
        kernel_id = call.body.get("id")
        for ref, kernel in self.store.kernels.items():
            if kernel["id"] == kernel_id:
                return ref
        raise ApiError(404, f"kernel id {kernel_id} not found")

    def _resolve_sources(self, body: dict, now: float) -> tuple:
        sources, invalid = [], {"datasets": [], "kernels": []}
        for ref in body.get("datasetDataSources") or []:
            self.store.poll_processing(ref)  # a push that names a processing version waits as a status poll does
            ready = self.store.ready_version(ref, now)
            if ready is None:
                invalid["datasets"].append(ref)
            else:
                sources.append({"kind": "dataset", "ref": ref, "version": ready["number"]})
        for ref in body.get("kernelDataSources") or []:
            version = self.store.kernel_version(ref)
            if version is None:
                invalid["kernels"].append(ref)
            else:
                sources.append({"kind": "kernel", "ref": ref, "version": version["number"]})
        return sources, invalid

    def _refusal(self, owner: str, now: float) -> Optional[str]:
        cfg = self.config
        if self.store.running_gpu_sessions(owner) >= cfg.max_gpu_sessions:
            if any(g["owner"] == owner and g["enable_gpu"] for g in self.store.ghosts):
                self.faults.ghost_refused()  # kaggle-cli #185: refused although fewer than N run
            return CONCURRENCY_REFUSAL.format(n=cfg.max_gpu_sessions)
        period = cfg.wall(cfg.quota_period_s)
        allowed = cfg.allowance(self.store.quota_period(now, period))
        if self.store.gpu_seconds_used(owner, now, period, cfg.time_scale) >= allowed:
            return QUOTA_REFUSAL.format(when=iso(self.store.quota_window(now, period)[1]))
        return None

    # -- reading ---------------------------------------------------------------------------------
    def _lookup(self, call: Call, lag: bool = False) -> tuple:
        owner = call.body.get("userName") or call.user
        ref = f"{owner}/{slug_of(call.body, 'kernelSlug')}"
        kernel = self.store.kernels.get(ref)  # `slug/N` names no kernel: 403, as Kaggle answers it (PR #1201)
        if kernel is None or not kernel["versions"] or not self._visible(call.user, kernel):
            raise kernel_rules.hidden(ref)
        number = kernel_rules.version_number(call.body.get("versionLabel"))
        version = self.store.kernel_version(ref, f"v{number}" if number else None)
        if version is None:  # a label naming no version: 404, as for a label Kaggle cannot read (PR #1201)
            raise ApiError(404, f"Kernel {ref} has no version {number}")
        faults = self.faults
        newest = version is self.store.kernel_version(ref)
        if lag and (not number or (faults.lag_pinned and newest)) and version["number"] > 1 and \
                faults.lagging(ref, version["number"], version["pushed"], time.time()):
            # status_lag: Kaggle's "latest" (pessimistically: even the newest version asked by its label) still
            # answers the previous version for a while after a push
            version = self.store.kernel_version(ref, f"v{version['number'] - 1}")
        return ref, version

    @staticmethod
    def _visible(user: str, kernel: dict) -> bool:
        """A kernel its owner sees, or a public one (pushes default to private: kaggle_api_extended.py)."""
        return kernel["owner"] == user or not kernel["versions"][-1]["meta"].get("isPrivate", True)

    def GetKernelSessionStatus(self, call: Call) -> dict:
        ref, version = self._lookup(call, lag=True)
        if version.get("wedged"):
            self._end_wedge(ref, version)
        reply = {"status": version["status"]}
        if version.get("failure"):
            reply["failureMessage"] = version["failure"]
        return reply

    def _end_wedge(self, ref: str, version: dict) -> None:
        """A wedged version (the `wedge` fault) reads RUNNING until its session limit passed and the fault's
        status calls after it were answered; then what its process ended with."""
        with self.store.lock:
            wedged = version.get("wedged")
            limit = (version.get("started") or version["pushed"]) + self.config.wall(version["timeout_s"])
            if not wedged or time.time() < limit or self.faults.still_wedged(version["output_key"]):
                return
            self.runner.end(ref, version, wedged["status"], wedged["failure"], wedged["exit_code"], time.time())
            del version["wedged"]
            self.store.save()

    def DeleteKernel(self, call: Call) -> dict:
        """`kaggle kernels delete`: the kernel and all its versions; a session still running (or wedged) is
        killed, Kaggle offers no other way to stop a session. Its slot and its GPU time are not freed at once: it
        becomes a ghost that Kaggle goes on counting for the fault plan's delete_lag (on by default: the session
        count has counted killed and deleted kernels, kaggle-cli #185; a deleted notebook's session has stayed
        running for a day, kaggle-cli #937, kaggle-benchmarks #89); Store.owner_answered ends it."""
        owner = call.body.get("userName") or call.user
        ref = f"{owner}/{slug_of(call.body, 'kernelSlug')}"
        if owner != call.user:
            raise ApiError(403, f"Permission denied: {call.user} cannot delete {owner}'s kernels")
        with self.store.lock:
            kernel = self.store.kernels.get(ref)
            if kernel is None:
                raise ApiError(404, f"Kernel {ref} not found")
            active = [v["number"] for v in kernel["versions"] if v["status"] in ACTIVE]
        for number in active:  # killed first, outside the store's lock: the runner takes it to finish
            self.runner.delete(ref, number)
        with self.store.lock:
            kernel = self.store.kernels.get(ref)
            if kernel is None:
                raise ApiError(404, f"Kernel {ref} not found")
            now = time.time()
            lag = self.faults.delete_lag
            for version in kernel["versions"]:
                if version["status"] in ACTIVE:
                    self.runner.end(ref, version, "CANCEL_ACKNOWLEDGED", "The kernel was deleted.", None, now,
                                    charge=not lag)
                    version.pop("wedged", None)
                    if lag:
                        self.store.add_ghost(owner, ref, version["number"], version, now, lag + 1)  # + the delete's own
            del self.store.kernels[ref]
            # its files move aside (tests read what was pushed); a kernel pushed again under the slug starts empty
            folder, aside = self.store.root / "kernels" / ref, self.store.root / "deleted" / ref / str(kernel["id"])
            if folder.exists():
                aside.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(folder), str(aside))
            self.store.data.setdefault("deleted_kernels", []).append({"ref": ref, "deleted": now, **kernel})
            self.store.save()
        return {}

    def ListKernelSessionOutput(self, call: Call) -> dict:
        ref, version = self._lookup(call, lag=True)
        served = version
        if self.faults.stale_output and version["status"] == "ERROR":
            # Kaggle has been seen to return the previous successful run's files after a failure
            earlier = [v for v in self.store.kernels[ref]["versions"]
                       if v["number"] < version["number"] and v["status"] == "COMPLETE"]
            served = earlier[-1] if earlier else version
        files = [] if served["status"] in ACTIVE else tree_files(self.store.kernel_dir(ref, served["number"]) / "working")
        size = min(int(call.body.get("pageSize") or 20), 200)
        start = int(call.body.get("pageToken") or 0)
        page = files[start:start + size]
        base = f"{call.base}/files/kout/{ref}/v{served['number']}"
        reply = {"files": [{"fileName": name, "url": f"{base}/{urllib.parse.quote(name)}?k={served['output_key']}"}
                           for name, _ in page],
                 "log": json.dumps(self._log(ref, served["number"]))}
        if start + size < len(files):
            reply["nextPageToken"] = str(start + size)
        return reply

    def _log(self, ref: str, number: int) -> list:
        live = self.runner.live_log(ref, number)
        return live if live is not None else read_log(self.store.kernel_dir(ref, number) / "log.json")

    def _metadata(self, ref: str) -> dict:
        kernel = self.store.kernels[ref]
        latest = kernel["versions"][-1]
        meta = {"id": kernel["id"], "ref": ref, "title": kernel["title"], "author": kernel["owner"],
                "slug": kernel["slug"], "lastRunTime": iso(latest.get("started") or latest["pushed"]),
                "currentVersionNumber": latest["number"], "language": "python", "kernelType": "script"}
        meta.update(latest["meta"])
        return meta

    def GetKernel(self, call: Call) -> dict:
        ref, version = self._lookup(call)
        directory = self.store.kernel_dir(ref, version["number"])
        pushed = directory / "pushed.txt"
        source = (pushed if pushed.exists() else directory / "source.py").read_text()
        meta = self._metadata(ref)
        return {"metadata": meta, "blob": {"source": source, "language": meta.get("language", "python"),
                                           "kernelType": meta.get("kernelType", "script"),
                                           "slug": self.store.kernels[ref]["slug"]}}

    def ListKernels(self, call: Call) -> dict:
        user = call.body.get("user") or call.user
        search = (call.body.get("search") or "").lower()
        refs = sorted(r for r, k in self.store.kernels.items()
                      if k["owner"] == user and search in r.lower() and k["versions"])
        return {"kernels": [self._metadata(r) for r in refs]}

    def GetAcceleratorQuotaStatistics(self, call: Call) -> dict:
        cfg, now = self.config, time.time()
        period = cfg.wall(cfg.quota_period_s)
        used = self.store.gpu_seconds_used(call.user, now, period, cfg.time_scale)
        # timeReserved: what the running sessions still hold, the rest of each one's timeout (kaggle-cli #1029);
        # the allowance of this period, which varies from week to week (kaggle-benchmarks #79)
        reserved = self.store.gpu_seconds_reserved(call.user, now, cfg.time_scale, cfg.wall)
        allowed = cfg.allowance(self.store.quota_period(now, period))
        has_run = any(e["owner"] == call.user for e in self.store.data["quota"])
        return {"quotaRefreshTime": iso(self.store.quota_window(now, period)[1]),
                "gpuQuota": {"timeUsed": duration(used), "timeReserved": duration(reserved),
                             "totalTimeAllowed": duration(allowed),
                             "minimumTimeAllowed": duration(min(allowed, cfg.gpu_quota_s)), "hasEverRun": has_run},
                "tpuQuota": {"timeUsed": duration(0), "timeReserved": duration(0),
                             "totalTimeAllowed": duration(20 * 3600), "minimumTimeAllowed": duration(20 * 3600)}}

    # -- plain GETs ------------------------------------------------------------------------------
    def output_file(self, parts: list, query: dict, headers: dict):
        """GET /files/kout/<owner>/<slug>/v<N>/<path>?k=<key>: no auth, the key in the url is the capability."""
        if len(parts) < 4:
            raise ApiError(404, "not found")
        ref, label, rel = f"{parts[0]}/{parts[1]}", parts[2], parts[3:]
        version = self.store.kernel_version(ref, label)
        if version is None or query.get("k") != version["output_key"] or ".." in rel:
            raise ApiError(404, "not found")
        return file_reply(self.store.kernel_dir(ref, version["number"]) / "working" / "/".join(rel), headers)

    def log_stream(self, user: str, owner: str, slug: str, timeout: float = 600.0) -> tuple[str, Iterator[bytes]]:
        """GET /api/v1/kernels/logs/stream/<owner>/<slug> as Kaggle serves it: while the session runs, server-sent
        events (one `data: {json}` per log line, replayed from the start on every connection, `data: END_OF_LOG`
        when it ends); once it is done, the stored log as one JSON array (not SSE). The `stream_drop` fault cuts
        a live stream after some events (a load balancer's idle cut): the client reconnects. It names no version
        (a version in its path is no route: 404, kaggle-cli PR #1201); a kernel the caller cannot see is 403,
        as the client's handler reads it (kaggle_api_extended.py kernels_logs_stream, PR #999)."""
        ref = f"{owner}/{slug}"
        kernel = self.store.kernels.get(ref)
        if kernel is None or not kernel["versions"] or not self._visible(user, kernel):
            raise kernel_rules.hidden(ref)
        version = kernel["versions"][-1]
        if version["status"] not in ACTIVE:
            return "application/json", iter([json.dumps(self._log(ref, version["number"])).encode()])
        return "text/event-stream", self._events(ref, version, timeout)

    def _events(self, ref: str, version: dict, timeout: float) -> Iterator[bytes]:
        cut = self.faults.stream_cut(ref, version["number"])
        sent, deadline, quiet = 0, time.time() + timeout, 0
        while True:
            entries = self._log(ref, version["number"])
            for entry in entries[sent:]:
                if cut is not None and sent >= cut:
                    raise ConnectionAbortedError("stream_drop")
                yield f"data: {json.dumps(entry)}\n\n".encode()
                sent, quiet = sent + 1, 0
            if version["status"] not in ACTIVE or time.time() > deadline:
                yield b"data: END_OF_LOG\n\n"
                return
            quiet += 1
            if quiet % 5 == 0:  # a keep-alive comment each second of silence (the client reads 512-byte chunks)
                yield b":" + b" " * 509 + b"\n\n"
            time.sleep(0.2)


def notebook_to_script(text: str) -> str:
    """The code cells of an .ipynb, in order; shell (!) and magic (%) lines are commented out."""
    try:
        cells = json.loads(text).get("cells", [])
    except ValueError:
        return text
    lines = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        lines += [("# " + line) if line.lstrip().startswith(("!", "%")) else line for line in source.splitlines()]
        lines.append("")
    return "\n".join(lines) + "\n"
