"""A push/publish/harvest cycle with a known fake key: the key must not appear in any file the emulator
stored (kernel sources, inputs, outputs, logs, datasets, blobs, state), in any kernel's environment, in the
client's temporary files, or in any log line or printed output of this process."""
from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import pytest

from kaggle_fixtures import FAKE_KEY, USER, backend_for, isolated_env, make_emulator, push_script, wait_state  # noqa: F401
from relay.orchestrator.kaggle import KaggleCredentials, KaggleError, KernelState, SessionKernel
from relay.orchestrator.kaggle.credentials import resolve
from kaggle_fixtures import TOY_SPEC_YAML

NEEDLES = [FAKE_KEY.encode(), base64.b64encode(f"{USER}:{FAKE_KEY}".encode())]


def files_containing(root: Path) -> list:
    hits = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            if any(needle in data for needle in NEEDLES):
                hits.append(str(path))
    return hits


def test_no_secret_in_anything_stored_or_logged(make_emulator, isolated_env, tmp_path, caplog, capfd, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KAGGLE_USERNAME", USER)  # the developer's shell has the key; kernels must not inherit it
    monkeypatch.setenv("KAGGLE_KEY", FAKE_KEY)
    emu = make_emulator(faults={"seed": 3, "methods": {"*": {"rate": 0.2}}})
    backend = backend_for(emu)
    assert backend.client.credentials == resolve()  # picked up from the environment, as in production
    assert FAKE_KEY not in repr(backend.client.credentials)

    data = tmp_path / "data"
    data.mkdir()
    (data / "x.txt").write_text("payload")
    backend.publish_folder(data, f"{USER}/secret-test-data", "Secret test data", "v1")
    session = SessionKernel(kernel=f"{USER}/toy-secret", title="Toy secret", spec_text=TOY_SPEC_YAML,
                            run_id="secret-1", data_dataset=f"{USER}/secret-test-data")
    assert backend.push_session(session).pushed
    dump_env = "import os, json; json.dump(dict(os.environ), open('env.json', 'w'))\nprint(sorted(os.environ))\n"
    push_script(backend, f"{USER}/env-dump", dump_env, gpu=False)
    assert wait_state(backend, f"{USER}/env-dump").state is KernelState.COMPLETE
    assert wait_state(backend, session.kernel, 90).state is KernelState.COMPLETE
    out = backend.download_output(session.kernel, tmp_path / "out", "secret-1")
    assert out.fresh
    backend.publish_folder(out.directory / "relay", f"{USER}/secret-test-ckpt", "Secret test checkpoint", "s1")

    env_dump = (emu.store.kernel_dir(f"{USER}/env-dump", 1) / "working" / "env.json").read_text()
    assert "KAGGLE_KEY" not in env_dump and "KAGGLE_INPUT_DIR" in env_dump
    assert files_containing(emu.store.root) == []
    assert files_containing(tmp_path / "out") == []
    assert files_containing(Path(os.environ["TMPDIR"])) == []
    printed = capfd.readouterr()
    assert FAKE_KEY not in printed.out + printed.err
    assert all(FAKE_KEY not in record.getMessage() for record in caplog.records)
    assert all(NEEDLES[1].decode() not in record.getMessage() for record in caplog.records)


def test_push_refuses_a_source_that_contains_the_key(make_emulator):
    emu = make_emulator()
    backend = backend_for(emu)
    leaky = SessionKernel(kernel=f"{USER}/leaky-session", title="Leaky session", run_id="leak-1",
                          spec_text=TOY_SPEC_YAML + f"# key: {FAKE_KEY}\n")
    with pytest.raises(KaggleError, match="contains the Kaggle credential"):
        backend.push_session(leaky)
    assert f"{USER}/leaky-session" not in emu.store.kernels


def test_credentials_never_in_repr_and_sources():
    creds = KaggleCredentials("bob", key="s3cr3t")
    assert "s3cr3t" not in repr(creds) and creds.redact("x s3cr3t y") == "x *** y"

    class SecretBlock:  # the shape of a Prefect Secret block: .get() returns the stored value
        def get(self):
            return {"username": "bob", "key": "s3cr3t"}

    assert resolve(SecretBlock()) == creds
    assert resolve(lambda: '{"username": "bob", "key": "s3cr3t"}') == creds
    assert resolve("tok", username="bob").token == "tok"
