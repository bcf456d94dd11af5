"""Where the tick workflow that `relay init` writes installs kaggle-relay from: only something that exists, pinned
so that it cannot change under a running relay (a session's code version is part of what it resumes from) and
so that no stranger's package runs in the job that holds the Kaggle key (kaggle-relay is not on the package
index: a name there would be whoever registers it first).

- default: the kaggle-relay running `relay init`. Imported from a git checkout: that checkout's commit from the
  remote its branch tracks, `kaggle-relay @ git+https://HOST/OWNER/REPO@<40-hex commit>`. Installed by pip from
  a git or https URL: the URL and commit (or sha256) pip recorded (PEP 610's direct_url.json). Anything else
  (no remote, a local path, a wheel from a folder): one line asking for --git or --wheel.
- `--git URL[@REF]`: that repository at REF (default the tag vVERSION; a commit pins it for good).
- `--wheel FILE`: the wheel, committed beside the workflow, installed by its file URL with its sha256, which pip
  checks before installing.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

from relay.shared.errors import InputError

WHEEL_DIR = ".github/relay"
# the checkout the running relay is imported from (relay/orchestrator/this file): no import of `relay` itself
RUNNING_CHECKOUT = Path(__file__).resolve().parents[2]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_WHEEL = re.compile(r"^kaggle_relay-([^-]+)-")
_VERSION = re.compile(r'^__version__ = "([^"]+)"', re.M)
_SCP = re.compile(r"^(?:[^@/:]+@)?([^/:]+):(?!//)(.+)$")  # git's scp-like remote: git@github.com:OWNER/REPO.git
_ASK = ("pass --git URL@COMMIT (a repository a GitHub runner can clone) or --wheel FILE (a kaggle_relay wheel, "
        "committed beside the workflow)")


@dataclass
class Pin:
    """A pip requirement the workflow installs, files to copy into the repository, and notes for the user."""
    requirement: str
    copies: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def from_wheel(wheel: Path, version: str) -> Pin:
    match = _WHEEL.match(wheel.name)
    if not wheel.is_file() or wheel.suffix != ".whl" or not match:
        raise InputError(f"--wheel: {wheel} is not a kaggle_relay wheel file (build one with `pip wheel --no-deps"
                         " .` in a kaggle-relay checkout)")
    if match.group(1) != version:
        raise InputError(f"--wheel: {wheel.name} is kaggle-relay {match.group(1)}, this relay is {version}: pin the"
                         " version that writes the workflow (the wheel of this version, or that version's relay init)")
    rel = f"{WHEEL_DIR}/{wheel.name}"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    # a file URL with a #sha256 fragment: pip refuses the wheel if its hash differs (a relative path takes none)
    return Pin(f"kaggle-relay @ file://${{{{ github.workspace }}}}/{rel}#sha256={digest}", {rel: wheel})


def from_git(git: str, version: str) -> Pin:
    url, at, ref = git.rpartition("@")
    if not at or "/" in ref or ":" in ref:  # an @ inside the URL (ssh://git@host/...), not a ref after it
        url, ref = git, ""
    if not re.match(r"^(https|ssh)://\S+/\S+$", url):
        raise InputError(f"--git: {git!r} is not a repository URL (https://github.com/OWNER/kaggle-relay[@REF])")
    return Pin(f"kaggle-relay @ git+{url}@{ref or 'v' + version}")  # REF: the tag of the version that writes this


def running(version: str, checkout: Path = RUNNING_CHECKOUT) -> Pin:
    """The pin of the kaggle-relay imported from `checkout` (a source checkout, or site-packages); InputError,
    one line naming --git and --wheel, where it cannot be pinned to something a runner can fetch."""
    checkout = Path(checkout).resolve()
    if (checkout / "pyproject.toml").is_file():
        return _from_checkout(checkout, version)
    try:
        dist = metadata.distribution("kaggle-relay")
        ours = Path(str(dist.locate_file("relay/__init__.py"))).resolve() == checkout / "relay" / "__init__.py"
        recorded = dist.read_text("direct_url.json") if ours else None
    except metadata.PackageNotFoundError:
        recorded = None
    pin = from_direct_url(recorded) if recorded else None
    if pin is None:
        raise InputError(f"--git, --wheel: neither given, and the kaggle-relay in {checkout} was not installed"
                         f" from a git or https URL pip recorded: {_ASK}")
    return pin


def from_direct_url(text: str) -> Optional[Pin]:
    """What pip recorded of an install (PEP 610), as a pinned requirement; None for a local path or folder."""
    info = json.loads(text)
    vcs, archive = info.get("vcs_info") or {}, info.get("archive_info") or {}
    sub = info.get("subdirectory")
    if vcs.get("vcs") == "git" and _COMMIT.match(vcs.get("commit_id", "")):
        url = clonable(info.get("url", ""))
        tail = f"#subdirectory={sub}" if sub else ""
        return Pin(f"kaggle-relay @ git+{url}@{vcs['commit_id']}{tail}") if url else None
    digest = (archive.get("hashes") or {}).get("sha256") or (archive.get("hash") or "").partition("sha256=")[2]
    url = info.get("url", "")
    if digest and url.startswith("https://") and "@" not in url.partition("//")[2].partition("/")[0]:
        return Pin(f"kaggle-relay @ {url}#sha256={digest}")
    return None


def clonable(url: str) -> Optional[str]:
    """`url` as an https URL a runner can clone without keys (credentials dropped: this goes into a pushed
    file); None for a local path or file URL. ssh and scp-like remotes become https on the same host."""
    url = url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scp = _SCP.match(url)
        if scp is None or url.startswith(("/", ".")):
            return None
        host, path = scp.groups()
    elif scheme in ("https", "ssh", "git+ssh"):
        authority, _, path = rest.partition("/")
        host = authority.rpartition("@")[2]
        host = host.partition(":")[0] if scheme != "https" else host  # an ssh port is no https port
    else:
        return None
    path = path.strip("/")
    if not host or "/" not in path or any(c in url for c in " \"'#?$`\\"):
        return None
    return f"https://{host}/{path}"


def _from_checkout(checkout: Path, version: str) -> Pin:
    def refuse(why: str) -> InputError:
        return InputError(f"--git, --wheel: neither given, and {why}: {_ASK}")

    top = _git(checkout, "rev-parse", "--show-toplevel")
    if top is None:
        raise refuse(f"the kaggle-relay checkout {checkout} is not a git repository")
    commit = _git(checkout, "rev-parse", "--verify", "-q", "HEAD^{commit}")
    if not commit:
        raise refuse(f"the kaggle-relay checkout {checkout} has no commit")
    remote = _remote(checkout)
    if remote is None:
        raise refuse(f"the kaggle-relay checkout {checkout} has no git remote")
    url = clonable(_git(checkout, "remote", "get-url", remote) or "")
    if url is None:
        raise refuse(f"the remote {remote!r} of {checkout} is not an https or ssh URL a runner can clone")
    sub = checkout.relative_to(Path(top).resolve()).as_posix()
    source = _git(checkout, "show", f"{commit}:{'' if sub == '.' else sub + '/'}relay/__init__.py") or ""
    committed = _VERSION.search(source)
    if committed is None or committed.group(1) != version:
        raise refuse(f"commit {commit[:12]} of {checkout} is kaggle-relay "
                     f"{committed.group(1) if committed else '(none)'}, this relay is {version}")
    pin = Pin(f"kaggle-relay @ git+{url}@{commit}" + (f"#subdirectory={sub}" if sub != "." else ""))
    if not _git(checkout, "branch", "-r", "--list", f"{remote}/*", "--contains", commit):
        pin.notes.append(f"commit {commit[:12]} is on no branch of {remote} ({url}) as this checkout last saw it:"
                         " push it before the workflow's first tick, which installs it from there")
    if _git(checkout, "status", "--porcelain", "--untracked-files=no"):
        pin.notes.append(f"{checkout} has uncommitted changes: the workflow installs commit {commit[:12]} without"
                         " them")
    return pin


def _remote(checkout: Path) -> Optional[str]:
    """The remote the current branch tracks, else `origin`, else the only remote."""
    branch = _git(checkout, "symbolic-ref", "-q", "--short", "HEAD")
    tracked = _git(checkout, "config", f"branch.{branch}.remote") if branch else None
    remotes = (_git(checkout, "remote") or "").split()
    if tracked in remotes:
        return tracked
    if "origin" in remotes:
        return "origin"
    return remotes[0] if len(remotes) == 1 else None


def _git(cwd: Path, *args: str) -> Optional[str]:
    """git's output, stripped; None where git is missing or says no."""
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
