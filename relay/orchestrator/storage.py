"""What a relay stores on Kaggle: the versions and bytes of its datasets (checkpoint, features, final model, the
user's control record). Kaggle counts every version of a private dataset against the account's storage quota, and
past it a create is answered with success and the dataset then 404s (kaggle-cli #284); the checkpoint's versions
are bounded by kaggle.checkpoint_versions (relay/orchestrator/kaggle/datasets.py: the publish that would keep one
more deletes the older ones, Kaggle having no per-version delete). The step claims (kaggle/lease.py) are datasets
of under a kilobyte each and are not counted here.
"""
from __future__ import annotations

from relay.orchestrator.chain import Names
from relay.orchestrator.kaggle import control_record
from relay.orchestrator.kaggle.types import NotFound


def relay_storage(backend, names: Names) -> dict:
    """{"datasets": {ref: {"versions", "bytes"}}, "versions", "bytes"}: every version each dataset holds, its
    files' bytes summed (a version whose files cannot be listed, processing or FAILED, counts 0 bytes)."""
    datasets = {}
    for ref in (names.checkpoint_dataset, names.features_dataset, names.model_dataset,
                control_record.dataset(names.owner, names.name)):
        versions = backend.dataset_versions(ref)
        if not versions:
            continue
        size = 0
        for number in versions:
            try:
                size += sum(f.size for f in backend.list_dataset_files(ref, number))
            except NotFound:
                pass
        datasets[ref] = {"versions": len(versions), "bytes": size}
    return {"datasets": datasets, "versions": sum(d["versions"] for d in datasets.values()),
            "bytes": sum(d["bytes"] for d in datasets.values())}


def storage_line(stored: dict, checkpoint_versions: int) -> str:
    """One line for `relay status` and the flow's log."""
    parts = ", ".join(f"{ref} {d['versions']} version(s) {_size(d['bytes'])}" for ref, d in stored["datasets"].items())
    return (f"stored on Kaggle: {stored['versions']} dataset version(s), {_size(stored['bytes'])}"
            + (f" ({parts})" if parts else "") + f"; checkpoint versions kept at most {checkpoint_versions}")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1000 ** 3), ("MB", 1000 ** 2), ("KB", 1000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
