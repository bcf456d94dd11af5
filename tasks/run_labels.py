"""What the Prefect UI's runs list says of a relay's flow run: its name (`<relay>: session 3`, `<relay>: tick`) and its
tags (the relay's name, the Kaggle account). Where the relay lives on Kaggle is chain.Names.links."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional


RELAY_TAG = "relay:"
ACCOUNT_TAG = "kaggle:"  # the Kaggle account a run is tagged with: what `relay run --submit` reads back


# Prefect names a run (flow_run_name) before the flow's body starts, outside the body's read_once scope: the reads a
# run's name was made from wait here, by flow run, and serve the body's, so a deployment's run opens each spec once.
_READ_FOR_NAME: Dict[Optional[str], Mapping[str, bytes]] = {}


def spec_name(path: str) -> str:
    """The relay's name from its spec file, before the flow validates it (a run name only: the file's stem if it
    cannot be read). Under `relay run` (relay.shared.spec.read_once) the bytes it already read, not another open."""
    from relay.shared.spec import name_of

    return name_of(path) or Path(path).stem


def _names_of(paths: Iterable[str]) -> List[str]:
    """The relays' names for this flow run's name; the bytes they were read from are kept for its body."""
    from prefect.runtime import flow_run

    from relay.shared.spec import read_once

    with read_once() as held:
        names = [spec_name(p) for p in paths]
        _READ_FOR_NAME[flow_run.id] = dict(held)
    return names


@contextmanager
def read_once_after_naming() -> Iterator[None]:
    """The flow body's read_once scope (relay.shared.spec), served by the reads its run's name was made from."""
    from prefect.runtime import flow_run

    from relay.shared.spec import read_once

    with read_once(_READ_FOR_NAME.pop(flow_run.id, {})):
        yield


def relay_run_name() -> str:
    """The `relay` flow's run name at its start (flow_run_name): `<relay>: tick` or `<relay>: watch`; a watch
    renames its run `<relay>: session N` as it follows session N (`label`)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return f"{_names_of([params.get('spec', 'relay')])[0]}: {params.get('mode', 'watch')}"


def relays_run_name() -> str:
    """The `relays` flow's run name: `relays <a>, <b>: tick` or `... watch`; past three relays, `relays <a>, <b>,
    <c> and N more: watch` (a name is not a list of 200 relays)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    names = _names_of(params.get('specs') or [])
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"relays {shown}: {params.get('mode', 'watch')}"


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
