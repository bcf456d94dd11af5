"""datasets.DatasetApiService and blobs.BlobApiService: resumable uploads, dataset versions with a processing
delay, status, listing, metadata and downloads."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import time
import zipfile
from pathlib import Path
from typing import Optional

from relay.emulator.config import EmulatorConfig
from relay.emulator.faults import FaultPlan
from relay.emulator.protocol import ApiError, Call, Reply, file_reply, iso, slug_of, tree_files
from relay.emulator.store import Store, version_state

_CONTENT_RANGE = re.compile(r"^bytes (?:(\d+)-(\d+)|\*)/(\d+)$")


class DatasetsService:
    def __init__(self, store: Store, config: EmulatorConfig, faults: FaultPlan):
        self.store, self.config, self.faults = store, config, faults

    # -- blobs -----------------------------------------------------------------------------------
    def StartBlobUpload(self, call: Call) -> dict:
        size = int(call.body.get("contentLength") or 0)
        name = os.path.basename(str(call.body.get("name") or ""))
        if not name:
            raise ApiError(400, "StartBlobUpload: a file name is required")
        token = "blobtok-" + secrets.token_hex(8)
        with self.store.lock:
            # seq: the upload's place in this server's order, so seeded upload faults repeat (the token is random)
            self.store.blobs[token] = {"name": name, "size": size, "received": 0, "owner": call.user,
                                       "created": time.time(), "seq": len(self.store.blobs)}
            self.store.save()
        self.store.blob_path(token).parent.mkdir(parents=True, exist_ok=True)
        self.store.blob_path(token).write_bytes(b"")
        return {"token": token, "createUrl": f"{call.base}/upload/{token}"}

    def put_blob(self, token: str, headers: dict, body: bytes) -> Reply:
        """PUT createUrl: whole file, or `Content-Range: bytes S-E/N` to resume, or `bytes */N` to ask how
        much arrived (answered 308 with `Range: bytes=0-K`)."""
        blob = self.store.blobs.get(token)
        if blob is None:
            return Reply(404, b"upload expired or unknown", {"Content-Type": "text/plain"})
        path = self.store.blob_path(token)
        content_range = headers.get("Content-Range")
        start = 0
        if content_range:
            match = _CONTENT_RANGE.match(content_range.strip())
            if not match:
                return Reply(400, b"bad Content-Range", {"Content-Type": "text/plain"})
            if match.group(1) is None:  # probe
                return self._upload_state(blob)
            start = int(match.group(1))
        with self.store.lock:
            if start != blob["received"]:
                return self._upload_state(blob)
            cut = self.faults.upload_cut(f"{blob.get('seq', token)}:{blob['name']}", blob.setdefault("attempts", 0),
                                             len(body))
            blob["attempts"] += 1
            kept = body if cut is None else body[:cut]
            with open(path, "r+b") as f:
                f.seek(start)
                f.write(kept)
                f.truncate()
            blob["received"] = start + len(kept)
            self.store.save()
        if cut is not None:
            return Reply(503, b"upload interrupted (injected fault)", {"Content-Type": "text/plain"})
        return self._upload_state(blob)

    @staticmethod
    def _upload_state(blob: dict) -> Reply:
        if blob["received"] >= blob["size"]:
            return Reply(200, b"{}", {"Content-Type": "application/json"})
        headers = {"Content-Type": "text/plain"}
        if blob["received"] > 0:
            headers["Range"] = f"bytes=0-{blob['received'] - 1}"
        return Reply(308, b"", headers)

    # -- creating versions -----------------------------------------------------------------------
    def CreateDataset(self, call: Call) -> dict:
        body = call.body
        owner, slug = body.get("ownerSlug") or call.user, slug_of(body, "slug")
        if owner != call.user:
            raise ApiError(403, f"Permission denied: {call.user} cannot create datasets for {owner}")
        ref = f"{owner}/{slug}"
        with self.store.lock:
            if ref in self.store.datasets:
                return {"status": "error", "error": f"The requested title \"{body.get('title')}\" is already"
                                                    f" in use by a dataset. Please choose another title."}
            files = self._check_tokens(call.user, body.get("files") or [])
            self.store.datasets[ref] = {
                "id": self.store.new_id(), "owner": owner, "slug": slug, "title": body.get("title") or slug,
                "subtitle": body.get("subtitle") or "", "description": body.get("description") or "",
                "license": body.get("licenseName") or "unknown", "is_private": bool(body.get("isPrivate", True)),
                "created": time.time(), "versions": []}
            self._add_version(ref, files, "Initial release")
            if self._over_storage(call.user):  # answered "ok" all the same, then absent (kaggle-cli #284)
                self._drop_version(ref)
                del self.store.datasets[ref]
                self.store.save()
        return {"ref": ref, "url": f"{call.base}/datasets/{ref}", "status": "ok"}

    def CreateDatasetVersion(self, call: Call) -> dict:
        ref = f"{call.body.get('ownerSlug') or call.user}/{slug_of(call.body, 'datasetSlug')}"
        return self._new_version(call, ref)

    def CreateDatasetVersionById(self, call: Call) -> dict:
        wanted = int(call.body.get("id") or 0)
        ref = next((r for r, d in self.store.datasets.items() if d["id"] == wanted), None)
        if ref is None:
            raise ApiError(404, f"Dataset id {wanted} not found")
        return self._new_version(call, ref)

    def _new_version(self, call: Call, ref: str) -> dict:
        body = call.body.get("body") or {}
        with self.store.lock:
            dataset = self._dataset(ref)
            if dataset["owner"] != call.user:
                raise ApiError(403, f"Permission denied: {call.user} cannot version {ref}")
            latest = dataset["versions"][-1] if dataset["versions"] else None
            # a new version is refused (403) while the previous one still processes (kagglehub PR #182, #181)
            if latest and (version_state(latest, time.time()) == "processing" or
                           self.faults.refuse_version(ref, latest["number"])):
                latest["polls_left"] = max(0, latest.get("polls_left", 0) - 1)  # the refused attempt polls too
                self.store.save()
                raise ApiError(403, f"Dataset {ref} is still processing its latest version; try again later")
            files = self._check_tokens(call.user, body.get("files") or [])
            self._add_version(ref, files, body.get("versionNotes") or "")
            # the quota is checked before any old version is deleted (the pessimistic reading: undocumented)
            if self._over_storage(call.user):  # answered "ok" all the same, never shown (kaggle-cli #284)
                self._drop_version(ref)
                return {"ref": ref, "url": f"{call.base}/datasets/{ref}", "status": "ok"}
            for key in ("subtitle", "description"):
                if body.get(key):
                    dataset[key] = body[key]
            if body.get("deleteOldVersions"):
                # the client's `datasets version --delete-old-versions` (kaggle_api_extended.dataset_create_version,
                # kagglesdk ApiCreateDatasetVersionRequestBody.delete_old_versions): Kaggle's one way to free a
                # dataset's old versions (no per-version delete); done at once here, the pessimistic reading
                while len(dataset["versions"]) > 1:
                    self._drop_version(ref, dataset["versions"][0])
            self.store.save()
        return {"ref": ref, "url": f"{call.base}/datasets/{ref}", "status": "ok"}

    def _over_storage(self, owner: str) -> bool:
        """Whether the owner's private datasets, every version counted, exceed the private storage quota."""
        quota = self.config.private_storage_bytes
        return bool(quota) and self.store.private_bytes(owner) > quota

    def _drop_version(self, ref: str, version: Optional[dict] = None) -> None:
        """Forget a version (the newest by default) and its files."""
        dataset = self.store.datasets[ref]
        version = version or dataset["versions"][-1]
        dataset["versions"].remove(version)
        shutil.rmtree(self.store.dataset_dir(ref, version["number"]).parent, ignore_errors=True)

    def _check_tokens(self, user: str, files: list) -> list:
        blobs = []
        for item in files:
            blob = self.store.blobs.get(item.get("token", ""))
            if blob is None or blob["owner"] != user:
                raise ApiError(400, f"Invalid upload token {item.get('token')!r}")
            if blob["received"] < blob["size"]:
                raise ApiError(400, f"Upload of {blob['name']} is incomplete ({blob['received']}/{blob['size']} bytes)")
            blobs.append((item["token"], blob))
        if not blobs:
            raise ApiError(400, "A dataset version needs at least one file")
        return blobs

    def _add_version(self, ref: str, blobs: list, notes: str) -> None:
        """A new version holds exactly the files uploaded for it; zips are unpacked into a folder."""
        dataset = self.store.datasets[ref]
        number = (dataset["versions"][-1]["number"] if dataset["versions"] else 0) + 1  # old ones may be deleted
        target = self.store.dataset_dir(ref, number)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for token, blob in blobs:
            source = self.store.blob_path(token)
            if blob["name"].lower().endswith(".zip") and zipfile.is_zipfile(source):
                _unpack(source, target / blob["name"][:-4])
            else:
                shutil.copyfile(source, target / blob["name"])
        now = time.time()
        files = [list(f) for f in tree_files(target)]
        unit = self.config.dataset_processing_bytes_per_poll
        # processing grows with size: one status poll per `unit` bytes (counted in polls, not seconds, so a test
        # does not depend on the machine's speed); it may end FAILED (kagglesdk DatabundleVersionStatus.FAILED)
        dataset["versions"].append({"number": number, "notes": notes, "created": now,
                                    "ready_at": now + self.config.dataset_processing_delay,
                                    "polls_left": sum(size for _, size in files) // unit if unit else 0,
                                    "failed": self.faults.fails_processing(ref, number), "files": files,
                                    "reprocess_left": self.faults.dataset_reprocessing})
        self.store.save()

    # -- reading ---------------------------------------------------------------------------------
    def _dataset(self, ref: str) -> dict:
        dataset = self.store.datasets.get(ref)
        if dataset is None:
            raise ApiError(404, f"Dataset {ref} not found")
        return dataset

    def _ref(self, call: Call) -> str:
        return f"{call.body.get('ownerSlug') or call.user}/{slug_of(call.body, 'datasetSlug')}"

    def _current(self, ref: str) -> Optional[dict]:
        return self.store.ready_version(ref, time.time())

    def GetDatasetStatus(self, call: Call) -> dict:
        """The newest version's processing (kagglesdk DatabundleVersionStatus: ... READY, FAILED, DELETED,
        REPROCESSING); each call while it processes is one of the polls its size costs."""
        with self.store.lock:
            dataset = self._dataset(self._ref(call))
            latest = dataset["versions"][-1]
            state = version_state(latest, time.time())
            name = {"processing": "BLOBS_RECEIVED", "failed": "FAILED", "ready": "READY"}[state]
            if state == "processing" and latest.get("polls_left", 0) > 0:
                latest["polls_left"] -= 1
                self.store.save()
            elif state == "processing" and latest["ready_at"] <= time.time() and latest.get("reprocess_left", 0) > 0:
                latest["reprocess_left"] -= 1  # the dataset_reprocessing fault: a second wait, named so
                self.faults.injected["dataset_reprocessing"] += 1
                name = "REPROCESSING"
                self.store.save()
        return {"status": name}

    def GetDataset(self, call: Call) -> dict:
        ref = self._ref(call)
        dataset = self._dataset(ref)
        current = self._current(ref)
        now = time.time()
        reply = {"id": dataset["id"], "ref": ref, "title": dataset["title"], "subtitle": dataset["subtitle"],
                 "description": dataset["description"], "ownerName": dataset["owner"], "ownerRef": dataset["owner"],
                 "creatorName": dataset["owner"], "isPrivate": dataset["is_private"],
                 "licenseName": dataset["license"], "url": f"{call.base}/datasets/{ref}",
                 "lastUpdated": iso(dataset["versions"][-1]["created"]),
                 "versions": [{"versionNumber": v["number"], "versionNotes": v["notes"], "creationDate": iso(v["created"]),
                               "status": version_state(v, now)}
                              for v in reversed(dataset["versions"])]}
        if current:
            reply["currentVersionNumber"] = current["number"]
            reply["totalBytes"] = sum(size for _, size in current["files"])
        return reply

    def _version(self, ref: str, number: Optional[int]) -> dict:
        dataset = self._dataset(ref)
        if number:
            found = next((v for v in dataset["versions"] if v["number"] == int(number)), None)
            if found is dataset["versions"][-1] and self.faults.hide_version(ref, found["number"]):
                found = None  # a new version 404s for a while after its creation (kaggle-cli #890)
            elif found is not None and version_state(found, time.time()) == "failed":
                found = None  # processing FAILED: nothing to list or download
        else:
            found = self._current(ref)
        if found is None:
            raise ApiError(404, f"Dataset {ref} version {number or 'current'} not found or not ready")
        return found

    def ListDatasetFiles(self, call: Call) -> dict:
        ref = self._ref(call)
        version = self._version(ref, call.body.get("datasetVersionNumber"))
        size = min(int(call.body.get("pageSize") or 20), 200)
        start = int(call.body.get("pageToken") or 0)
        page = version["files"][start:start + size]
        reply = {"datasetFiles": [{"ref": f"{ref}/{name}", "datasetRef": ref, "name": name, "totalBytes": bytes_,
                                   "creationDate": iso(version["created"])} for name, bytes_ in page]}
        if start + size < len(version["files"]):
            reply["nextPageToken"] = str(start + size)
        return reply

    def GetDatasetMetadata(self, call: Call) -> dict:
        ref = self._ref(call)
        dataset = self._dataset(ref)
        current = self._current(ref) or dataset["versions"][-1]
        return {"info": {"datasetId": dataset["id"], "datasetSlug": dataset["slug"], "ownerUser": dataset["owner"],
                         "title": dataset["title"], "subtitle": dataset["subtitle"],
                         "description": dataset["description"], "isPrivate": dataset["is_private"],
                         "licenses": [{"name": dataset["license"]}], "keywords": [],
                         "data": [{"name": n, "totalBytes": b} for n, b in current["files"]]}}

    def DownloadDataset(self, call: Call) -> Reply:
        ref = self._ref(call)
        version = self._version(ref, call.body.get("datasetVersionNumber"))
        name = call.body.get("fileName")
        if name and name not in {n for n, _ in version["files"]}:
            raise ApiError(404, f"File {name} not found in {ref}")
        location = f"{call.base}/files/ds/{ref}/v{version['number']}/{name or '__all__.zip'}"
        return Reply(302, b"", {"Location": location, "Content-Type": "text/plain"})

    def dataset_file(self, parts: list, headers: dict) -> Reply:
        """GET /files/ds/<owner>/<slug>/v<N>/<path or __all__.zip> (authenticated by the caller)."""
        if len(parts) < 4 or ".." in parts:
            raise ApiError(404, "not found")
        ref = f"{parts[0]}/{parts[1]}"
        version = self._version(ref, int(parts[2].lstrip("v")))
        root = self.store.dataset_dir(ref, version["number"])
        rel = "/".join(parts[3:])
        if rel == "__all__.zip":
            return file_reply(self._zip_of(root), headers, "application/zip")
        return file_reply(root / rel, headers)

    @staticmethod
    def _zip_of(root: Path) -> Path:
        archive = root.parent / "all.zip"
        if not archive.exists():
            tmp = archive.with_suffix(".tmp")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
                for name, _ in tree_files(root):
                    zf.write(root / name, name)
            os.replace(tmp, archive)
        return archive

    def DeleteDataset(self, call: Call) -> dict:
        """DeleteDataset (the client's `dataset_delete`): the dataset and every version, at once (how soon Kaggle
        frees its storage is not in the record). Kaggle has no per-version delete (kagglesdk datasets service)."""
        ref = self._ref(call)
        if ref.split("/", 1)[0] != call.user:
            raise ApiError(403, f"Permission denied: {call.user} cannot delete {ref}")
        with self.store.lock:
            self._dataset(ref)  # 404 when absent
            del self.store.datasets[ref]
            shutil.rmtree(self.store.root / "datasets" / ref, ignore_errors=True)
            self.store.save()
        return {}


def _unpack(archive: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            parts = Path(member.filename).parts
            if member.filename.startswith("/") or ".." in parts:
                raise ApiError(400, f"zip member {member.filename!r} escapes the dataset")
        zf.extractall(target)
