"""The emulator's persistent state: one JSON document plus file trees under the state folder.

  DIR/state.json                          kernels (with versions), datasets (with versions), blobs, quota ledger,
                                          ghosts (sessions of deleted kernels that Kaggle still counts)
  DIR/kernels/<owner>/<slug>/v<N>/        source.py, input/<mounts>, working/, log.json
  DIR/datasets/<owner>/<slug>/v<N>/files/ the files of one dataset version (uploaded zips unpacked)
  DIR/blobs/<token>                       upload bytes
Credentials are never stored here (users live in the config, in memory). A restarted emulator keeps all of
this; runs that were in flight when it stopped are marked ERROR, as Kaggle would lose them.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

ACTIVE = ("QUEUED", "RUNNING")


def version_state(version: dict, now: float) -> str:
    """A dataset version's processing: "processing" (its wall delay or its status polls not yet spent), then
    "failed" (the dataset_failed fault) or "ready"."""
    if version["ready_at"] > now or version.get("polls_left", 0) > 0 or version.get("reprocess_left", 0) > 0:
        return "processing"
    return "failed" if version.get("failed") else "ready"


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.path = self.root / "state.json"
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
            self._fail_interrupted_runs()
        else:
            self.data = {"format": 1, "created": time.time(), "next_id": 1000,
                         "kernels": {}, "datasets": {}, "blobs": {}, "quota": []}
            self.save()

    def save(self) -> None:
        with self.lock:
            write_json(self.path, self.data)

    def new_id(self) -> int:
        with self.lock:
            self.data["next_id"] += 1
            return self.data["next_id"]

    def _fail_interrupted_runs(self) -> None:
        for kernel in self.data["kernels"].values():
            for version in kernel["versions"]:
                if version["status"] in ACTIVE:
                    version.update(status="ERROR", failure="The emulator restarted while this session ran.",
                                   ended=version.get("ended") or time.time())
        self.save()

    # -- lookups ---------------------------------------------------------------------------------
    @property
    def kernels(self) -> dict:
        return self.data["kernels"]

    @property
    def datasets(self) -> dict:
        return self.data["datasets"]

    @property
    def blobs(self) -> dict:
        return self.data["blobs"]

    def kernel_dir(self, ref: str, number: int) -> Path:
        return self.root / "kernels" / ref / f"v{number}"

    def dataset_dir(self, ref: str, number: int) -> Path:
        return self.root / "datasets" / ref / f"v{number}" / "files"

    def blob_path(self, token: str) -> Path:
        return self.root / "blobs" / token

    def kernel_version(self, ref: str, label: Optional[str] = None) -> Optional[dict]:
        kernel = self.kernels.get(ref)
        if not kernel or not kernel["versions"]:
            return None
        if not label:
            return kernel["versions"][-1]
        number = int(str(label).lstrip("v"))
        return next((v for v in kernel["versions"] if v["number"] == number), None)

    def ready_version(self, ref: str, now: float) -> Optional[dict]:
        """The newest dataset version whose processing finished READY: what a kernel would mount."""
        dataset = self.datasets.get(ref)
        ready = [v for v in (dataset or {}).get("versions", []) if version_state(v, now) == "ready"]
        return ready[-1] if ready else None

    def poll_processing(self, ref: str) -> None:
        """One poll of the dataset's newest version's processing (its size costs polls, datasets_api.py)."""
        versions = (self.datasets.get(ref) or {}).get("versions") or []
        if versions and versions[-1].get("polls_left", 0) > 0:
            versions[-1]["polls_left"] -= 1
            self.save()

    def private_bytes(self, owner: str) -> int:
        """Bytes the owner's private datasets hold, every version counted (the private storage quota's measure)."""
        return sum(size for d in self.datasets.values() if d["owner"] == owner and d.get("is_private", True)
                   for v in d["versions"] for _, size in v["files"])

    def running_gpu_sessions(self, owner: str) -> int:
        """The owner's GPU sessions Kaggle counts: queued or running ones, and the ghosts of deleted kernels."""
        return sum(1 for ref, k in self.kernels.items() if k["owner"] == owner
                   for v in k["versions"] if v["status"] in ACTIVE and v.get("enable_gpu")) + \
            sum(1 for g in self.ghosts if g["owner"] == owner and g["enable_gpu"])

    # -- ghosts: deleted kernels' sessions still counted (faults.py delete_lag; kaggle-cli #185, #937) -------------
    @property
    def ghosts(self) -> list:
        return self.data.setdefault("ghosts", [])

    def add_ghost(self, owner: str, ref: str, number: int, version: dict, deleted: float, calls: int) -> None:
        """A session whose kernel was deleted: it holds its slot and its GPU time runs on for `calls` more requests
        of its owner (charged when it ends, from its start, as one ledger entry)."""
        self.ghosts.append({"owner": owner, "kernel": ref, "version": number, "enable_gpu": bool(version.get("enable_gpu")),
                            "started": version.get("started"), "deleted": deleted, "calls_left": calls})

    def owner_answered(self, owner: str, now: float, time_scale: float) -> None:
        """One request of `owner` was answered: its ghosts come one call nearer their end."""
        with self.lock:
            mine = [g for g in self.ghosts if g["owner"] == owner]
            if not mine:
                return
            for ghost in mine:
                ghost["calls_left"] -= 1
                if ghost["calls_left"] <= 0:
                    self.ghosts.remove(ghost)
                    if ghost["enable_gpu"] and ghost["started"]:
                        self.charge(owner, ghost["kernel"], ghost["version"], ghost["started"], now, time_scale)
            self.save()

    # -- quota -----------------------------------------------------------------------------------
    def quota_window(self, now: float, period_wall: float) -> tuple:
        """(start, end) wall times of the quota period containing `now`."""
        epoch = self.data["created"]
        index = int((now - epoch) // period_wall)
        return epoch + index * period_wall, epoch + (index + 1) * period_wall

    def quota_period(self, now: float, period_wall: float) -> int:
        """Which quota period `now` falls in (0: the first, from the store's creation)."""
        return int((now - self.data["created"]) // period_wall)

    def gpu_seconds_reserved(self, owner: str, now: float, time_scale: float, timeout_wall) -> float:
        """Kaggle seconds the owner's GPU sessions still hold: each queued or running one, the rest of its timeout
        (GetAcceleratorQuotaStatistics' timeReserved: time held by running sessions, kaggle-cli #1029)."""
        reserved = 0.0
        for kernel in self.kernels.values():
            if kernel["owner"] != owner:
                continue
            for v in kernel["versions"]:
                if v["status"] in ACTIVE and v.get("enable_gpu"):
                    elapsed = now - v["started"] if v.get("started") else 0.0
                    reserved += max(0.0, timeout_wall(v["timeout_s"]) - elapsed) * time_scale
        return reserved

    def gpu_seconds_used(self, owner: str, now: float, period_wall: float, time_scale: float) -> float:
        """Kaggle seconds of GPU used this period: finished runs from the ledger plus runs in flight."""
        start, end = self.quota_window(now, period_wall)
        used = sum(e["kaggle_seconds"] for e in self.data["quota"]
                   if e["owner"] == owner and start <= e["end"] < end)
        for kernel in self.kernels.values():
            if kernel["owner"] != owner:
                continue
            for v in kernel["versions"]:
                if v["status"] == "RUNNING" and v.get("enable_gpu") and v.get("started"):
                    used += (now - max(v["started"], start)) * time_scale
        for ghost in self.ghosts:  # a deleted kernel's session Kaggle still charges
            if ghost["owner"] == owner and ghost["enable_gpu"] and ghost["started"]:
                used += (now - max(ghost["started"], start)) * time_scale
        return used

    def charge(self, owner: str, ref: str, number: int, started: float, ended: float, time_scale: float) -> None:
        with self.lock:
            self.data["quota"].append({"owner": owner, "kernel": ref, "version": number, "start": started,
                                       "end": ended, "kaggle_seconds": (ended - started) * time_scale})
            self.save()
