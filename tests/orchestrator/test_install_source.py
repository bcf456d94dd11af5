"""Where `relay init`'s workflow installs kaggle-relay from (relay/orchestrator/install_source.py): only what exists,
pinned. Real git repositories in tmp_path stand for a kaggle-relay checkout (a pyproject.toml and relay/__init__.py
are all the pin reads); nothing is fetched.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from relay.orchestrator import install_source, repo_init
from relay.shared.errors import InputError

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]


def _checkout(root: Path, version: str = "1.2.3", remote: str | None = None, sub: str = ".") -> str:
    """A git repository at `root` holding a kaggle-relay `version` in its folder `sub`; its commit."""
    (root / sub / "relay").mkdir(parents=True)
    (root / sub / "pyproject.toml").write_text('[project]\nname = "kaggle-relay"\n')
    (root / sub / "relay/__init__.py").write_text(f'__version__ = "{version}"\n')
    subprocess.run([*GIT, "init", "-q", str(root)], check=True)
    subprocess.run([*GIT, "-C", str(root), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(root), "commit", "-qm", "relay"], check=True)
    if remote:
        subprocess.run([*GIT, "-C", str(root), "remote", "add", "origin", remote], check=True)
    return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_default_pins_the_running_checkouts_commit_from_its_remote(tmp_path, spawns_processes):
    commit = _checkout(tmp_path / "relay-src", remote="git@github.com:me/kaggle-relay.git")
    pin = install_source.running("1.2.3", tmp_path / "relay-src")
    assert pin.requirement == f"kaggle-relay @ git+https://github.com/me/kaggle-relay.git@{commit}"
    assert len(pin.notes) == 1 and "push it before the workflow's first tick" in pin.notes[0]  # no origin/* here
    subprocess.run(["git", "-C", str(tmp_path / "relay-src"), "update-ref", "refs/remotes/origin/main", commit],
                   check=True)  # as a fetch after the push leaves it
    assert install_source.running("1.2.3", tmp_path / "relay-src").notes == []

    (tmp_path / "relay-src/relay/__init__.py").write_text('__version__ = "1.2.3"  # edited\n')
    assert any("uncommitted changes" in note for note in install_source.running("1.2.3", tmp_path / "relay-src").notes)
    with pytest.raises(InputError, match=r"is kaggle-relay 1\.2\.3, this relay is 9\.9\.9: pass --git"):
        install_source.running("9.9.9", tmp_path / "relay-src")  # the committed version is what a runner gets


def test_a_checkout_inside_a_larger_repository_pins_its_subdirectory(tmp_path, spawns_processes):
    commit = _checkout(tmp_path / "mono", remote="https://github.com/me/mono", sub="tools/kaggle-relay")
    pin = install_source.running("1.2.3", tmp_path / "mono/tools/kaggle-relay")
    assert pin.requirement == f"kaggle-relay @ git+https://github.com/me/mono@{commit}#subdirectory=tools/kaggle-relay"


@pytest.mark.parametrize("remote, why", [
    ("(not a git repository)", "is not a git repository"),
    (None, "has no git remote"),
    ("/srv/git/kaggle-relay", "is not an https or ssh URL a runner can clone"),
    ("file:///srv/git/kaggle-relay", "is not an https or ssh URL a runner can clone"),
])
def test_a_checkout_a_runner_cannot_fetch_is_one_line_naming_both_flags(tmp_path, remote, why, spawns_processes):
    if remote == "(not a git repository)":
        (tmp_path / "src/relay").mkdir(parents=True)
        (tmp_path / "src/pyproject.toml").write_text("")
    else:
        _checkout(tmp_path / "src", remote=remote)
    with pytest.raises(InputError) as err:
        install_source.running("1.2.3", tmp_path / "src")
    line = str(err.value)
    assert "\n" not in line and why in line and "--git URL@COMMIT" in line and "--wheel FILE" in line


def test_plan_without_flags_uses_the_running_pin_and_checks_existing_files_first(tmp_path, spawns_processes):
    commit = _checkout(tmp_path / "src", remote="https://github.com/me/kaggle-relay")
    (tmp_path / "user").mkdir()
    (tmp_path / "user/t.py").write_text("")
    files = repo_init.plan(tmp_path / "user", "t.py", "1.2.3", checkout=tmp_path / "src")
    assert files.install == f"kaggle-relay @ git+https://github.com/me/kaggle-relay@{commit}"
    assert f'RELAY_PACKAGE: "{files.install}"' in files.texts[repo_init.WORKFLOW]
    with pytest.raises(InputError, match="--wheel, --git: give one"):
        repo_init.plan(tmp_path / "user", "t.py", "1.2.3", wheel=tmp_path / "x.whl", git="https://h/x")
    assert sorted(p.name for p in (tmp_path / "user").iterdir()) == ["t.py"]  # plan writes nothing
    (tmp_path / "user/spec.yaml").write_text("")
    with pytest.raises(InputError, match="spec.yaml: already exists"):  # before any git question
        repo_init.plan(tmp_path / "user", "t.py", "1.2.3", checkout=tmp_path / "nowhere")


@pytest.mark.parametrize("remote, https", [
    ("https://github.com/me/kaggle-relay.git", "https://github.com/me/kaggle-relay.git"),
    ("https://me:ghp_secret@github.com/me/kaggle-relay/", "https://github.com/me/kaggle-relay"),  # never pushed
    ("ssh://git@github.com:22/me/kaggle-relay.git", "https://github.com/me/kaggle-relay.git"),
    ("git@gitlab.com:group/sub/kaggle-relay.git", "https://gitlab.com/group/sub/kaggle-relay.git"),
    ("/srv/kaggle-relay", None), ("./kaggle-relay", None), ("file:///srv/kaggle-relay", None),
    ("http://github.com/me/kaggle-relay", None), ("https://github.com/me", None),
    ("https://github.com/me/$(curl x)", None),
])
def test_remotes_become_an_https_url_without_credentials_or_nothing(remote, https):
    assert install_source.clonable(remote) == https


def test_what_pip_recorded_of_a_url_install_is_pinned():
    commit = "a" * 40
    git = {"url": "https://github.com/me/kaggle-relay", "vcs_info": {"vcs": "git", "commit_id": commit,
                                                                     "requested_revision": "main"}}
    assert install_source.from_direct_url(json.dumps(git)).requirement == \
        f"kaggle-relay @ git+https://github.com/me/kaggle-relay@{commit}"
    wheel = {"url": "https://example.org/kaggle_relay-1.2.3-py3-none-any.whl", "archive_info": {
        "hashes": {"sha256": "b" * 64}}}
    assert install_source.from_direct_url(json.dumps(wheel)).requirement == \
        f"kaggle-relay @ https://example.org/kaggle_relay-1.2.3-py3-none-any.whl#sha256={'b' * 64}"
    for local in ({"url": "file:///home/me/kaggle-relay", "dir_info": {"editable": True}},
                  {"url": "file:///home/me/kaggle-relay", "vcs_info": {"vcs": "git", "commit_id": commit}},
                  {"url": "https://example.org/kaggle_relay.whl", "archive_info": {}}):
        assert install_source.from_direct_url(json.dumps(local)) is None


def test_a_wheel_is_installed_by_its_file_url_and_sha256_and_git_keeps_its_ref(tmp_path):
    wheel = tmp_path / "kaggle_relay-1.2.3-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    pin = install_source.from_wheel(wheel, "1.2.3")
    digest = hashlib.sha256(b"not really a wheel").hexdigest()
    assert pin.requirement == ("kaggle-relay @ file://${{ github.workspace }}/.github/relay/"
                               f"kaggle_relay-1.2.3-py3-none-any.whl#sha256={digest}")
    assert pin.copies == {f".github/relay/{wheel.name}": wheel}
    git = install_source.from_git("https://github.com/me/kaggle-relay", "1.2.3").requirement
    assert git == "kaggle-relay @ git+https://github.com/me/kaggle-relay@v1.2.3"
    ssh = install_source.from_git("ssh://git@github.com/me/kaggle-relay@abc123", "1.2.3").requirement
    assert ssh == "kaggle-relay @ git+ssh://git@github.com/me/kaggle-relay@abc123"
