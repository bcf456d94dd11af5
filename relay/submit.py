"""`relay run SPEC --submit` (the CLI's side: it talks to the Prefect server; relay/orchestrator knows nothing of
Prefect): a flow run of the one generic deployment, `relay/run`, on the Prefect server at
PREFECT_API_URL, followed to its end from this terminal; `relay run A B --submit`: one of `relays/relays`, the
`relays` flow over every spec.

The deployments take any spec: their parameters are the specs' absolute paths and the outputs folder, so the
worker must see the same paths (a process worker on this machine, or a checkout shared at the same path).
While the run goes on, its log lines are printed as the server receives them; at the end, the outcome, and
for a failed run the reason the relay stopped (not only "Failed").
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from relay.shared.errors import InputError
from tasks.run_labels import ACCOUNT_TAG  # a relay's flow run is tagged with the Kaggle account it runs as

DEPLOYMENT = "relay/run"
SEVERAL = "relays/relays"  # several specs: the relays flow


def submit(spec_paths: Sequence[Path], out: Path, tick: bool, poll_seconds: Optional[float],
           credentials_block: Optional[str], emit: Callable[[str], None] = print,
           follow_every_s: float = 2.0) -> tuple[str, str, Optional[str]]:
    """Create the flow run (of relay/run for one spec, relays/relays for several: the cap is the specs'
    kaggle.account_sessions) and follow it; returns
    (final state name, its message, the Kaggle account the run's tags name: the worker's, None if it never said)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.exceptions import ObjectNotFound

    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise InputError("--submit: PREFECT_API_URL is not set (the Prefect server to submit to); without"
                         " --submit the relay runs here")
    deployment_name = DEPLOYMENT if len(spec_paths) == 1 else SEVERAL
    paths = [str(Path(p).resolve()) for p in spec_paths]
    parameters = {"state_dir": str(out.resolve()), "mode": "tick" if tick else "watch",
                  **({"spec": paths[0]} if len(paths) == 1 else {"specs": paths})}
    if poll_seconds is not None:
        parameters["poll_seconds"] = poll_seconds
    if credentials_block:
        parameters["credentials_block"] = credentials_block
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound:
            name = deployment_name.split("/")[1]
            raise InputError(f"--submit: no deployment {deployment_name} on {url}: deploy it with prefect deploy"
                             f" --name {name} --no-prompt --prefect-file deploy/prefect.yaml (docs/prefect.md)") from None
        except Exception as err:  # noqa: BLE001 - unreachable, refused, auth: the server's own words
            raise InputError(f"--submit: cannot reach the Prefect server at {url} ({err})") from None
        run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        emit(f"submitted flow run {run.name} ({run.id}) of {deployment_name} on {url}; following it (Ctrl-C stops"
             " following, not the run)")
        seen = 0
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
        while True:
            current = client.read_flow_run(run.id)
            state = current.state
            while True:  # every log line so far, in order, each once
                logs = client.read_logs(log_filter=log_filter, offset=seen, limit=200, sort=LogSort.TIMESTAMP_ASC)
                for log in logs:
                    emit(f"{log.timestamp:%H:%M:%S} {_level(log.level)} {log.message}")
                seen += len(logs)
                if len(logs) < 200:
                    break
            if state is not None and state.is_final():
                return state.name, state.message or "", account_of(current.tags or [])
            time.sleep(follow_every_s)


def account_of(run_tags) -> Optional[str]:
    """The Kaggle account a flow run's tags name, None if none does."""
    return next((t[len(ACCOUNT_TAG):] for t in run_tags if t.startswith(ACCOUNT_TAG)), None)


def _level(number: int) -> str:
    return {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}.get(number, str(number))


def stop_reason(message: str) -> str:
    """The relay's own words out of a failed state's message ("Flow run encountered an exception: RelayFailed: ...")."""
    _, found, reason = message.partition("RelayFailed: ")
    return (reason if found else message).strip() or "no reason given (see the flow run's logs above)"
