"""The orchestrator reads and parses a spec once per process: `relay run spec.yaml --tick` parses it where it takes
it in and hands the flow what it parsed, never re-opening or re-parsing the file for the run's name, the flow, or the
text a push ships (issues 46, 59). Opens are counted with an audit hook on `open`, parses by counting calls of
relay.shared.spec.parse (every parse goes through it), during one in-process tick against the emulator (it pushes the
first session)."""
from __future__ import annotations

from contextlib import contextmanager

from byo_fixtures import RELAYED, copy_example
from kaggle_fixtures import FAKE_KEY, USER
from open_audit import opens_of


@contextmanager
def parses_counted(monkeypatch):
    """Within: a list that gets the source of each spec parse in this process."""
    from relay.shared import spec as spec_mod

    seen: list = []
    real = spec_mod.parse

    def counted(text, source="spec", *args, **kwargs):
        seen.append(source)
        return real(text, source, *args, **kwargs)

    monkeypatch.setattr(spec_mod, "parse", counted)
    yield seen
    monkeypatch.setattr(spec_mod, "parse", real)


def test_one_tick_opens_the_spec_at_most_twice_and_parses_it_once(relay_env, monkeypatch, tmp_path):
    import tasks.relay_host as relay_host
    from relay import launch

    relay_env.start()
    project = relay_env.root / "my-project"
    spec = copy_example("byo-plain", project, **RELAYED)  # the spec lies inside the code folder it ships
    relay_env.spec = spec
    monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: relay_env.backend())
    for name, value in {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": FAKE_KEY, "RELAY_KAGGLE_ENDPOINT": relay_env.emu.url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(project)
    lines: list = []
    with opens_of(spec) as opens, parses_counted(monkeypatch) as parses:
        code = launch.run("spec.yaml", out=str(tmp_path / "out"), tick=True, poll_seconds=0.3, emit=lines.append)
    assert code == 0, lines
    assert any(line.startswith("pushed: step 0/") for line in lines), lines
    assert len(relay_env.kernel_runs()) == 1
    assert parses == ["spec.yaml"], parses  # `relay run` parsed it; the flow took what it parsed
    # parsed once, shipped once inside the code bundle (the spec is a file of code.folder)
    assert opens, "the audit hook saw no open of the spec"
    print(f"{len(opens)} opens of the spec in one tick:\n" + "\n".join(opens))  # shown by `pytest -rP`
    assert len(opens) <= 2, f"{len(opens)} opens of {spec}:\n" + "\n".join(opens)


def test_the_text_shipped_is_the_text_parsed_and_read_text_s(toy_spec, tmp_path):
    from relay.front_door import read_spec

    spec = toy_spec(tmp_path)
    spec.write_bytes(spec.read_bytes().replace(b"\n", b"\r\n"))  # a spec saved on Windows
    loaded = read_spec(spec)
    assert loaded.text == spec.read_text()  # the spec_sha256 of kernels pushed before: unchanged
    assert loaded.spec.name == loaded.name == "toy-test" and loaded.path == spec


def test_a_flow_takes_a_path_the_text_or_the_spec_read_and_parses_it_once(toy_spec, tmp_path, monkeypatch):
    from relay.front_door import read_spec, spec_at_flow

    spec = toy_spec(tmp_path)
    with parses_counted(monkeypatch) as parses:
        loaded = read_spec(spec)
        assert spec_at_flow(loaded) is loaded  # `relay run`'s, as it is: no second parse
        assert len(parses) == 1
        assert spec_at_flow(str(spec)).spec == loaded.spec  # a deployment run's path
        monkeypatch.chdir(tmp_path)
        from_text = spec_at_flow(spec.read_text())  # or the spec's text itself
        assert from_text.spec == loaded.spec and from_text.text == loaded.text and from_text.path is None
        assert len(parses) == 3
