"""A deployment's flow run reads and parses its spec once (issues 46, 59): a worker runs the `relay` flow
(flows/one_relay.py, the entrypoint of deploy/prefect.yaml) with the spec's path, and the spec parsed and the text a
push ships come from one open and one parse (the run is named by the file until the flow renames it after its
relay). The flow is called here as a worker's flow run
calls it (Prefect names the run, then runs the body), in this process against the tests' Prefect server; one tick
against the emulator pushes the first session."""
from __future__ import annotations

from byo_fixtures import RELAYED, copy_example
from open_audit import opens_of
from test_spec_read_once import parses_counted


def test_a_deployment_tick_opens_the_spec_once_to_run_and_once_to_ship_and_parses_it_once(relay_env, monkeypatch):
    from prefect.client.orchestration import get_client

    relay_env.start()
    spec = copy_example("byo-plain", relay_env.root / "my-project", **RELAYED)  # inside the code folder it ships
    relay_env.spec = spec
    with opens_of(spec) as opens, parses_counted(monkeypatch) as parses:
        summary = relay_env.run_flow(monkeypatch, mode="tick")
    assert parses == [str(spec)], parses
    assert summary["state"] == "pushed", summary
    assert len(relay_env.kernel_runs()) == 1
    # parsed once (the run's name read from the same bytes), shipped once inside the code bundle
    assert opens, "the audit hook saw no open of the spec"
    print(f"{len(opens)} opens of the spec in one deployment tick:\n" + "\n".join(opens))  # `pytest -rP`
    assert len(opens) <= 2, f"{len(opens)} opens of {spec}:\n" + "\n".join(opens)
    with get_client(sync_client=True) as client:  # the run is still named after its relay
        names = [r.name for r in client.read_flow_runs() if r.parameters.get("spec") == str(spec)]
    assert names == [f"{relay_env.name}: tick"], names
