"""The orchestrator reads a spec once: `relay run spec.yaml --tick` parses it and ships the same bytes it parsed,
never re-opening the file for the run's name, the flow, or the text a push ships (issue 46). Counted with an audit
hook on `open` during one in-process tick against the emulator (it pushes the first session)."""
from __future__ import annotations

from byo_fixtures import RELAYED, copy_example
from kaggle_fixtures import FAKE_KEY, USER
from open_audit import opens_of

def test_one_tick_opens_the_spec_at_most_twice(relay_env, monkeypatch, tmp_path):
    import tasks.relay_step as relay_step
    from relay import launch

    relay_env.start()
    project = relay_env.root / "my-project"
    spec = copy_example("byo-plain", project, **RELAYED)  # the spec lies inside the code folder it ships
    relay_env.spec = spec
    monkeypatch.setattr(relay_step, "make_backend", lambda credentials_block=None: relay_env.backend())
    for name, value in {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": FAKE_KEY, "RELAY_KAGGLE_ENDPOINT": relay_env.emu.url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(project)
    lines: list = []
    with opens_of(spec) as opens:
        code = launch.run("spec.yaml", out=str(tmp_path / "out"), tick=True, poll_seconds=0.3, emit=lines.append)
    assert code == 0, lines
    assert any(line.startswith("pushed: step 0/") for line in lines), lines
    assert len(relay_env.kernel_runs()) == 1
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
    assert loaded.spec.name == loaded.name == "toy-test" and loaded.raw == spec.read_bytes()


def test_inside_read_once_a_spec_is_opened_once_and_outside_a_rewrite_is_seen(toy_spec, tmp_path):
    from relay.front_door import read_spec
    from relay.shared import spec as spec_mod

    spec = toy_spec(tmp_path)
    with opens_of(spec) as opens:
        with spec_mod.read_once():
            first = read_spec(spec)
            with spec_mod.read_once():  # a nested scope shares the outer one's reads
                assert spec_mod.name_of(spec) == "toy-test" and spec_mod.load(spec) == first.spec
            assert read_spec(spec).text == first.text
        assert len(opens) == 1, "\n".join(opens)
        spec.write_text(spec.read_text().replace("name: toy-test", "name: toy-other"))
        before = len(opens)
        assert read_spec(spec).name == "toy-other"  # the scope ended: the file is read again
        assert spec_mod.name_of(spec) == "toy-other"
        assert len(opens) == before + 2
