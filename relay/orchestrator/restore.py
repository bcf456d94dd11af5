"""Recover from a bad checkpoint version: make the newest version that still verifies the newest again.

A session told to resume from a checkpoint that turns out corrupt or partial (storage failed after the
handoff confirmed the upload) exits at once with "the mounted checkpoint ... is corrupt: ..."
(relay.kernel.session.checkpoint.load_resume). The orchestrator then walks the checkpoint dataset's versions newest
first, downloads each and verifies it end to end (the sha256 of every file in relay-publish.json, and the
checkpoint's own manifest), and publishes the first that passes again, with a `restored` record in its
progress.json. relay.orchestrator.chain.decide reads that record and pushes the next session from there. Idempotent: the
record is the same for the same failure, so a killed orchestrator's retry finds the version already made.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

from relay.orchestrator.chain import Names, parse_run_id
from relay.orchestrator.kaggle.datasets import MANIFEST, manifest_of
from relay.shared.manifest import list_valid, why_unusable
from relay.shared.progress import Progress

log = logging.getLogger(__name__)


class NoValidCheckpoint(RuntimeError):
    """No published version verifies: the relay cannot go on by itself."""


def restore_newest_valid(backend, names: Names, title: str, failed_run: str, why: str, local: Path) -> str:
    """Republish the newest verifying version of the checkpoint dataset; returns what was done, one line."""
    dataset = names.checkpoint_dataset
    versions = sorted(backend.dataset_versions(dataset), reverse=True)
    if not versions:
        raise NoValidCheckpoint(f"the checkpoint dataset {dataset} has no version to resume from")
    bad = versions[0]
    for number in versions:
        folder = local / "restore" / f"v{number}"
        problem = _fetch_verified(backend, dataset, number, folder)
        if problem:
            log.warning("checkpoint %s v%d does not verify: %s", dataset, number, problem)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        progress = Progress.load(folder / "progress.json")
        attempt = (parse_run_id(failed_run) or (0, 0))[1] + 1
        progress = replace(progress, restored={"bad_version": bad, "from_version": number, "after_run": failed_run,
                                               "attempt": attempt, "why": why})
        (folder / "progress.json").write_text(json.dumps(progress.to_dict(), indent=1, sort_keys=True))
        result = backend.publish_folder(folder, dataset, title,
                                        notes=f"v{number} again: v{bad} is corrupt ({why})")
        shutil.rmtree(folder, ignore_errors=True)
        return (f"checkpoint {dataset} v{bad} is corrupt ({why}); republished v{number}"
                f" (step {progress.global_step}) as v{result.version}")
    raise NoValidCheckpoint(
        f"checkpoint {dataset} v{bad} is corrupt ({why}) and no earlier version verifies"
        f" (tried v{', v'.join(map(str, versions))}). Way out: publish a valid checkpoint folder as a new version"
        f" of {dataset} (kaggle datasets version -p DIR), or delete the dataset to start the run over")


def _fetch_verified(backend, dataset: str, number: int, folder: Path) -> str:
    """Download version `number` into `folder`; '' when every file matches relay-publish.json and the
    checkpoint's manifest, else what is wrong."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    names = [f.name for f in backend.list_dataset_files(dataset, number)]
    if MANIFEST not in names:
        return f"no {MANIFEST}"
    for name in names:
        backend.download_dataset_file(dataset, name, folder, version=number)
    (folder / "dataset-metadata.json").unlink(missing_ok=True)  # the publisher writes its own
    expected = json.loads((folder / MANIFEST).read_text()).get("files", {})
    actual = manifest_of(folder)
    wrong = sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))
    if wrong:
        return f"{', '.join(wrong[:3])} differ from {MANIFEST}"
    if not list_valid(folder, verify_hashes=True):
        return why_unusable(folder)
    return ""
