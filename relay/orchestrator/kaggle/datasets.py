"""Publish a folder as a new Kaggle dataset version, exactly once, and wait until the next kernel can mount it.

- Staging: a temporary folder of symlinks to the caller's files (no copy, no writes into the caller's folder)
  plus dataset-metadata.json and relay-publish.json (sha256 of every file); subfolders go up as zips, which
  Kaggle unpacks.
- Exactly once: a marker (hash of the manifest) goes into the version notes and the dataset description.
  Before creating, and after any failure whose outcome is unknown, the dataset is read back and the marker
  searched for.
- Done means: status READY, currentVersionNumber moved past the one we started from, and ListDatasetFiles
  shows every file with its size.
- Kaggle's processing can end a version FAILED (kagglesdk datasets/types/dataset_enums.py DatabundleVersionStatus):
  the same files are published again as a new version (at most PUBLISH_ATTEMPTS in all); a failed version's
  marker does not count as published. REPROCESSING, like every state but READY and FAILED, is waited out.
- Storage: Kaggle counts every version against the account's private storage quota, and past it a create is
  answered with success and the dataset then 404s (kaggle-cli #284). Given `keep_versions`, the version that
  would keep one more than that asks Kaggle to delete the older ones (delete_old_versions: Kaggle has no
  per-version delete). A dataset still absent after a create that reported success is said to be that.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from relay.orchestrator.kaggle.client import KaggleClient
from relay.orchestrator.kaggle.retry import http_status, unless_absent
from relay.orchestrator.kaggle.types import DatasetFile, KaggleError, NotFound, PublishError, PublishResult
from relay.shared.errors import InputError

log = logging.getLogger(__name__)
MANIFEST = "relay-publish.json"
MAX_TOP_LEVEL = 50  # Kaggle keeps at most 50 top-level files per dataset
ABSENT_POLLS = 3  # a dataset created with success yet absent this many polls running: not kept (kaggle-cli #284)
STORAGE_HINT = ("the account's private dataset storage is likely full (Kaggle then drops what it accepted,"
                " kaggle-cli #284): delete datasets you do not need (kaggle datasets delete) or lower"
                " kaggle.checkpoint_versions")
PUBLISH_ATTEMPTS = 3  # versions made of one folder when Kaggle's processing ends FAILED


def manifest_of(folder: Path, known_sha256: Optional[Dict[str, str]] = None) -> Dict[str, dict]:
    """{relative name: {bytes, sha256}}; `known_sha256` (computed by the caller as it wrote the files, e.g.
    the handoff's streamed download) spares reading GBs a second time."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            rel = path.relative_to(folder).as_posix()
            if known_sha256 and rel in known_sha256:
                files[rel] = {"bytes": path.stat().st_size, "sha256": known_sha256[rel]}
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    return files


def list_dataset_files(client: KaggleClient, dataset: str, version: Optional[int] = None) -> List[DatasetFile]:
    ref = f"{dataset}/{version}" if version else dataset
    files: List[DatasetFile] = []
    token: Optional[str] = None
    while True:
        response = unless_absent(lambda t=token: client.run(
            f"files of {ref}", lambda api: api.dataset_list_files(ref, t, 200)), NotFound(f"dataset {ref}: not found"))
        if getattr(response, "error_message", None):
            raise KaggleError(f"dataset {ref}: {response.error_message}")
        files += [DatasetFile(f.name, int(f.total_bytes or 0), str(f.creation_date or "")) for f in response.files]
        token = response.next_page_token
        if not token:
            return files


class DatasetPublisher:
    def __init__(self, client: KaggleClient, wait_s: float = 1800.0, poll_s: float = 5.0):
        self.client, self.wait_s, self.poll_s = client, wait_s, poll_s

    def publish(self, folder: Path, dataset: str, title: str, notes: str = "",
                known_sha256: Optional[Dict[str, str]] = None, keep_versions: Optional[int] = None) -> PublishResult:
        if not folder.is_dir():
            raise InputError(f"publish: {folder} is not a folder")
        if not 6 <= len(title) <= 50:
            raise InputError(f"dataset title {title!r}: Kaggle needs 6 to 50 characters")
        slug = dataset.split("/", 1)[1]
        if not 6 <= len(slug) <= 50:
            raise InputError(f"dataset slug {slug!r}: Kaggle needs 6 to 50 characters")
        entries = [p for p in folder.iterdir() if p.name != MANIFEST]
        if not entries:
            raise InputError(f"publish: {folder} is empty")
        if len(entries) + 1 > MAX_TOP_LEVEL:
            raise InputError(f"publish: {folder} has {len(entries)} top-level entries; Kaggle keeps {MAX_TOP_LEVEL}")
        files = manifest_of(folder, known_sha256)
        marker = "relay-publish:" + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]

        created = False
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                return self._publish_once(folder, entries, dataset, title, notes, files, marker, created,
                                          keep_versions)
            except _ProcessingFailed as failed:
                created = True  # the dataset exists now, whoever made it
                if attempt == PUBLISH_ATTEMPTS:
                    raise PublishError(f"dataset {dataset}: processing ended FAILED {attempt} times; last: {failed}")
                log.warning("dataset %s: %s; publishing the same files again (attempt %d of %d)", dataset, failed,
                            attempt + 1, PUBLISH_ATTEMPTS)
        raise AssertionError("unreachable")

    def _publish_once(self, folder: Path, entries: list, dataset: str, title: str, notes: str,
                      files: Dict[str, dict], marker: str, created_before: bool,
                      keep_versions: Optional[int]) -> PublishResult:
        info = self.info(dataset)
        if info is not None and self._marker_version(info, marker):
            log.info("dataset %s: %s already published", dataset, marker)
            version = self._wait_ready(dataset, marker)
            self._verify(dataset, version, files)
            return PublishResult(dataset, version, False, True, files)
        if info is not None:
            self._wait_ready(dataset, None)  # a second version while one is processing is refused (403)

        stage = Path(tempfile.mkdtemp(prefix="relay-publish-"))
        try:
            for entry in entries:
                (stage / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
            manifest_bytes = (stage / MANIFEST).write_text(json.dumps({"marker": marker, "files": files}, indent=1))
            description = f"Published by kaggle-relay. {marker}"
            meta = {"id": dataset, "title": title, "licenses": [{"name": "CC0-1.0"}], "description": description}
            (stage / "dataset-metadata.json").write_text(json.dumps(meta))
            created = info is None and self._create(stage, dataset, marker)
            if not created:
                held = len(info["notes"]) if info is not None else 1
                delete_old = keep_versions is not None and held >= keep_versions
                if delete_old:
                    log.info("dataset %s: %d versions held (kaggle.checkpoint_versions %d): the new version deletes"
                             " the older ones", dataset, held, keep_versions)
                self._new_version(stage, dataset, f"{notes} {marker}".strip(), marker, delete_old)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        version = self._wait_ready(dataset, marker)
        files = dict(files, **{MANIFEST: {"bytes": manifest_bytes, "sha256": None}})  # ascii: characters are bytes
        self._verify(dataset, version, files)
        files.pop(MANIFEST)
        log.info("dataset %s: version %d ready (%d files)", dataset, version, len(files))
        return PublishResult(dataset, version, info is None and not created_before, False, files)

    # -- steps -----------------------------------------------------------------------------------
    def info(self, dataset: str) -> Optional[dict]:
        """Current version, description and version notes; None when the dataset does not exist."""
        def get(kaggle: Any) -> Any:
            from kagglesdk.datasets.types.dataset_api_service import ApiGetDatasetRequest

            request = ApiGetDatasetRequest()
            request.owner_slug, request.dataset_slug = dataset.split("/", 1)
            return kaggle.datasets.dataset_api_client.get_dataset(request)

        response = unless_absent(lambda: self.client.sdk(f"get dataset {dataset}", get), None)
        if response is None:
            return None
        notes = {v.version_number: v.version_notes or "" for v in response.versions or []}
        failed = sorted(v.version_number for v in response.versions or [] if str(v.status or "").lower() == "failed")
        return {"current": response.current_version_number or 0, "description": response.description or "",
                "notes": notes, "failed": failed}

    @staticmethod
    def _marker_version(info: dict, marker: str) -> Optional[int]:
        """The version created with `marker`: by its notes, else (a new dataset's first version, whose notes
        we cannot set) by the description that the same request wrote; a version whose processing FAILED is none."""
        failed = set(info.get("failed", ()))
        for number, notes in info["notes"].items():
            if marker in notes and number not in failed:
                return number
        newest = max(info["notes"], default=info["current"] or 1)
        # the description names the newest publish; it stands for a version only while no version's notes carry a
        # marker (a dataset's first version), never for a version Kaggle dropped or failed
        if marker in info["description"] and newest not in failed and not any(
                "relay-publish:" in notes for notes in info["notes"].values()):
            return newest
        return None

    def _landed(self, dataset: str, marker: str) -> bool:
        info = self.info(dataset)
        return info is not None and self._marker_version(info, marker) is not None

    def _create(self, stage: Path, dataset: str, marker: str) -> bool:
        """True when this call created the dataset; False when it already existed (version it instead)."""
        response = self._attempt(dataset, marker, lambda api: api.dataset_create_new(
            str(stage), public=False, quiet=True, dir_mode="zip"))
        if response is None:
            return True  # landed on an earlier attempt whose response was lost
        if response.error:
            if "already" in response.error.lower() and self.info(dataset) is not None:
                if self._landed(dataset, marker):
                    return True
                self._wait_ready(dataset, None)
                return False
            raise PublishError(f"create dataset {dataset}: {response.error}")
        return True

    def _new_version(self, stage: Path, dataset: str, notes: str, marker: str, delete_old: bool = False) -> None:
        response = self._attempt(dataset, marker, lambda api: api.dataset_create_version(
            str(stage), notes, quiet=True, dir_mode="zip", delete_old_versions=delete_old))
        if response is not None and response.error:
            raise PublishError(f"new version of {dataset}: {response.error}")

    def _attempt(self, dataset: str, marker: str, fn: Any) -> Any:
        """Run a create call; on an unknown outcome, look for the marker before trying again. A 403 means the
        previous version is still processing (Kaggle can say READY before it stops refusing): wait, with
        backoff, and ask again, for at most `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        delay = min(0.2, self.poll_s)
        while True:
            try:
                return self.client.run(f"publish {dataset}", fn,
                                       on_retry=lambda exc: self._stop_if_landed(dataset, marker))
            except _Landed:
                return None
            except Exception as exc:  # noqa: BLE001
                if http_status(exc) != 403 or time.monotonic() + delay > deadline:
                    raise
                log.info("dataset %s: a new version is refused while the previous one processes; asking again"
                         " in %.1f s", dataset, delay)
                if self._landed(dataset, marker):
                    return None
                self._wait_ready(dataset, None)
                time.sleep(delay)
                delay = min(self.poll_s, delay * 2)

    def _stop_if_landed(self, dataset: str, marker: str) -> None:
        if self._landed(dataset, marker):
            raise _Landed()

    def _wait_ready(self, dataset: str, marker: Optional[str]) -> int:
        """Poll until READY and currentVersionNumber reached the version made with `marker` (any when None).
        FAILED: _ProcessingFailed for our version; with no marker, nothing processes any more (0: a new version
        may be made)."""
        deadline = time.monotonic() + self.wait_s
        delay = min(0.2, self.poll_s)
        absent = 0
        while True:
            status = self._status(dataset)
            absent = absent + 1 if status == "absent" and marker else 0
            if absent >= ABSENT_POLLS:
                raise PublishError(f"dataset {dataset}: Kaggle answered its creation with success but does not show"
                                   f" it: {STORAGE_HINT}")
            if status == "failed":
                if marker is None:
                    return 0
                raise _ProcessingFailed(f"Kaggle's processing of the newest version ended FAILED")
            info = self.info(dataset) if status == "ready" else None
            if info is not None:
                target = self._marker_version(info, marker) if marker else info["current"]
                if target and info["current"] >= target:
                    return target
            if status == "deleted":
                raise PublishError(f"dataset {dataset}: processing ended {status}")
            if time.monotonic() > deadline:
                raise PublishError(f"dataset {dataset}: not ready after {self.wait_s:.0f}s (status {status}); if"
                                   f" the new version never shows: {STORAGE_HINT}")
            time.sleep(delay)
            delay = min(self.poll_s, delay * 2)

    def _status(self, dataset: str) -> str:
        status = unless_absent(lambda: self.client.run(f"status of {dataset}", lambda api: api.dataset_status(dataset)),
                               "absent")
        return str(status).lower()

    def _verify(self, dataset: str, version: int, files: Dict[str, dict]) -> None:
        listed = {f.name: f.size for f in self._files_of_new_version(dataset, version)}
        missing = [name for name, meta in files.items()
                   if name not in listed or (meta["bytes"] is not None and listed[name] != meta["bytes"])]
        if missing:
            raise PublishError(f"dataset {dataset} v{version} is incomplete: {missing[:5]}")

    def _files_of_new_version(self, dataset: str, version: int) -> List[DatasetFile]:
        """The listing of a version just made current. Kaggle answers 404 for a new version for a few seconds
        after its creation, though the dataset already names it current: look again, with backoff, for at
        most `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        delay = min(0.2, self.poll_s)
        while True:
            try:
                return list_dataset_files(self.client, dataset, version)
            except NotFound:
                if time.monotonic() + delay > deadline:
                    raise PublishError(f"dataset {dataset} v{version}: still not found {self.wait_s:.0f} s after"
                                       " Kaggle made it current") from None
                log.info("dataset %s v%d: not visible yet (a new version 404s for a while); looking again in"
                         " %.1f s", dataset, version, delay)
                time.sleep(delay)
                delay = min(self.poll_s, delay * 2)


class _Landed(Exception):
    """An earlier attempt whose response was lost did create the version."""


class _ProcessingFailed(Exception):
    """Kaggle's processing of the version just made ended FAILED: publish the same files again."""
