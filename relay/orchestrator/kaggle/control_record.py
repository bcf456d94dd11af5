"""The user's say over a relay (`relay stop`, `relay resume`), recorded on Kaggle so that every orchestrator sees it.

A relay may be driven from several places at once (a cron tick, `relay run` on another machine, a Prefect
deployment) that share nothing but Kaggle, so a stop kept on the user's machine would stop none of them. The
record is a one-file private dataset `<owner>/<relay>-control`; each `relay stop` or `relay resume` writes a new
version whose notes carry the record (the first version's notes cannot be set: its description carries it too),
and the newest version is what holds: {"state": "stopped" | "resumed", "by", "at", "why", and after
`relay stop --now` "ended_run": the run id of the session whose kernel was deleted; after the relay deleted a
wedged session's kernel, "deleted_run": its run id, so that a retry refused while Kaggle still counts the deleted
session (kaggle-cli #185) is decided again as the same new attempt by any orchestrator, and "deleted_charges":
the failed attempts' charges (relay/orchestrator/goodput.py) that retry's push carries}.
"""
from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Optional

from relay.shared.errors import InputError

if TYPE_CHECKING:
    from relay.orchestrator.kaggle.backend import KaggleBackend

PREFIX = "relay-control:"
STOPPED, RESUMED = "stopped", "resumed"


def dataset(owner: str, relay_name: str) -> str:
    return f"{owner}/{relay_name}-control"


def read(backend: "KaggleBackend", owner: str, relay_name: str) -> Optional[dict]:
    """The newest record, None when the relay was never stopped (no control dataset)."""
    info = backend.dataset_info(dataset(owner, relay_name))
    if info is None:
        return None
    newest = info["notes"].get(max(info["notes"])) if info["notes"] else ""
    for text in (newest or "", info["description"]):
        if PREFIX in text:
            try:
                return json.loads(text[text.index(PREFIX) + len(PREFIX):].strip())
            except ValueError:
                break
    raise InputError(f"dataset {dataset(owner, relay_name)} carries no readable relay control record:"
                     " delete it or rename the relay")


def write(backend: "KaggleBackend", owner: str, relay_name: str, state: str, why: str = "",
          ended_run: Optional[str] = None, deleted_run: Optional[str] = None,
          deleted_charges: Optional[list] = None) -> dict:
    """Record `state` as the newest version of the relay's control dataset; the record written."""
    record = {"state": state, "by": f"{backend.username}@{socket.gethostname()[:40]}:{os.getpid()}",
              "at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "why": why}
    if ended_run:
        record["ended_run"] = ended_run
    if deleted_run:
        record["deleted_run"] = deleted_run
        if deleted_charges:
            record["deleted_charges"] = deleted_charges
    text = f"{PREFIX} {json.dumps(record, sort_keys=True)}"
    ref, title = dataset(owner, relay_name), f"relay control {relay_name}"[:50]
    files = {"control.json": json.dumps(record, indent=1)}
    description = f"What the user of kaggle-relay {relay_name} decided (relay stop / relay resume). {text}"
    if not backend.create_dataset_if_absent(ref, title, description, files):
        backend.new_dataset_version(ref, title, description, files, notes=text)
    return record


def stop_line(record: Optional[dict]) -> str:
    """How a stop reads in the relay's reasons ("" unless the newest record is a stop)."""
    if not record or record.get("state") != STOPPED:
        return ""
    why = f": {record['why']}" if record.get("why") else ""
    return f"by {record.get('by', '?')} at {record.get('at', '?')}{why}"


def note_deleted(backend: "KaggleBackend", owner: str, relay_name: str, run_id: str, charges: list) -> dict:
    """Before the relay deletes a wedged session's kernel: the user's say as it stands, the deleted run, and the
    charges its retry carries."""
    previous = read(backend, owner, relay_name) or {}
    return write(backend, owner, relay_name, previous.get("state", RESUMED), previous.get("why", ""),
                 previous.get("ended_run"), deleted_run=run_id, deleted_charges=charges)


def carried_on(previous: dict) -> dict:
    """What a stop or a resume keeps of the record it replaces: the deleted run and its charges."""
    return {"deleted_run": previous.get("deleted_run"), "deleted_charges": previous.get("deleted_charges")}
