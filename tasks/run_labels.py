"""What the Prefect UI's runs list says of a relay's flow run: its name (`<relay>: session 3`, `<relay>: tick`) and its
tags (the relay's name, the Kaggle account). Where the relay lives on Kaggle is chain.Names.links."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional


RELAY_TAG = "relay:"
ACCOUNT_TAG = "kaggle:"  # the Kaggle account a run is tagged with: what `relay run --submit` reads back


def spec_name(spec) -> str:
    """A relay's name for its flow run's name, which Prefect makes before the flow's body parses the spec (the body
    then renames the run: `relay_name`): a spec `relay run` read, its own name; a path, the file's stem; the spec's
    text, "relay". Nothing is read or parsed for it."""
    from relay.shared.spec import LoadedSpec

    if isinstance(spec, LoadedSpec):
        return spec.name
    return "relay" if "\n" in str(spec) else Path(str(spec)).stem


def relay_run_name() -> str:
    """The `relay` flow's run name at its start (flow_run_name): `<relay>: tick` or `<relay>: watch`; a watch
    renames its run `<relay>: session N` as it follows session N (`label`)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return relay_name(spec_name(params.get("spec", "relay")), params.get("mode", "watch"))


def relay_name(name: str, mode: str) -> str:
    return f"{name}: {mode}"


def relays_run_name() -> str:
    """The `relays` flow's run name: `relays <a>, <b>: tick` or `... watch`; past three relays, `relays <a>, <b>,
    <c> and N more: watch` (a name is not a list of 200 relays)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return relays_name([spec_name(s) for s in params.get("specs") or []], params.get("mode", "watch"))


def relays_name(names: List[str], mode: str) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"relays {shown}: {mode}"


def tags(relay: str, account: str) -> List[str]:
    return [f"{RELAY_TAG}{relay}", f"{ACCOUNT_TAG}{account}"]


def account_tags(accounts: Iterable[str]) -> List[str]:
    """A `relays` run's tags: its accounts only. Prefect copies every tag of a run onto each of its events, so a tag
    per relay made the events table grow with the square of the relays (issue 60: ~23 rows an event at 30)."""
    return sorted({f"{ACCOUNT_TAG}{account}" for account in accounts})


def label(name: Optional[str] = None, add_tags: Iterable[str] = ()) -> None:
    """Rename the current flow run and/or add tags to it (its own tags, a deployment's, kept). Never fails a
    relay: a label is for people."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    run = context.flow_run
    new_tags = sorted(set(run.tags or []) | set(add_tags))
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run.id, name=name or None, tags=new_tags if add_tags else None)
        run.tags = new_tags
    except Exception:  # noqa: BLE001
        pass
