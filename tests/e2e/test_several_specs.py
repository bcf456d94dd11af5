"""`relay run a.yaml b.yaml` (issue 60): one account's relays from the command line, through the `relays` flow on
the embedded Prefect, against the emulator: both end done, each with its own sessions, never more at once than
the smallest kaggle.account_sessions of the specs; a spec named twice or a --submit without a server is one
line."""
from __future__ import annotations

import yaml

from byo_fixtures import RELAYED, copy_example, relay_in_shell
from kaggle_fixtures import KERNEL_ENV, make_emulator  # noqa: F401


def test_relay_run_with_two_specs_relays_both_through_the_relays_flow(make_emulator, tmp_path, spawns_processes):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    spec = copy_example("byo-plain", project, **RELAYED, **{"kaggle.account_sessions": 1})
    other = yaml.safe_load(spec.read_text())
    other["name"] = "byo-plain-b"
    (project / "b.yaml").write_text(yaml.safe_dump(other, sort_keys=False))

    ran = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "b.yaml", "--poll", "0.3")
    out = ran.stdout + ran.stderr[-3000:]
    assert ran.returncode == 0, out
    assert "relays byo-plain, byo-plain-b: to the end, at most 1 session(s) at once" in ran.stdout, out
    assert ran.stdout.count("done: step 60/60, 2 session(s) handed over") == 2, out
    with emulator.store.lock:
        kernels = {ref: k for ref, k in emulator.store.kernels.items()}
    assert sorted(len(k["versions"]) for k in kernels.values()) == [2, 2], sorted(kernels)
    # the account's one slot: no two sessions of the account ever ran at once
    spans = sorted((e["start"], e["end"]) for e in emulator.store.data["quota"])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    assert (project / "relay-runs" / "byo-plain" / "published" / "progress.json").is_file()
    assert (project / "relay-runs" / "byo-plain-b" / "published" / "progress.json").is_file()


def test_several_specs_refuse_one_name_twice_and_submit_in_one_line(make_emulator, tmp_path):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    (project / "copy.yaml").write_text((project / "spec.yaml").read_text())
    twice = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "copy.yaml")
    assert twice.returncode == 2 and twice.stderr.strip().endswith(
        "name: byo-plain named by more than one spec; each relay needs its own name"), twice.stderr
    submitted = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "copy.yaml", "--submit")
    assert submitted.returncode == 2 and submitted.stderr.strip().endswith(
        "--submit: PREFECT_API_URL is not set (the Prefect server to submit to); without --submit the relays run"
        " here"), submitted.stderr
    assert not emulator.store.kernels
