"""`relay init [PATH] --entry train.py`: what a user's own repository needs to be relayed from there, written
into it: a spec skeleton for their entry, and a GitHub Actions workflow that ticks the relay (the shape of this
project's .github/workflows/relay-tick.yml, its way (b): no Prefect server, Kaggle credentials from the
repository's secrets).

The workflow installs a pinned kaggle-relay, the version that wrote it, from something that exists
(install_source: by default the git commit of the kaggle-relay that runs `relay init`; `--git`; `--wheel`). It
checks that the version it got is the one pinned, so a moved tag or a stray wheel cannot change the relay under a
running run: a session's code version is part of what it resumes from. The actions it uses are pinned by commit
(ACTIONS) and the checkout keeps no token. Nothing is overwritten: every file is checked first, and one that
exists is one line and exit 2, before anything is written.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from relay.orchestrator import install_source
from relay.shared.errors import InputError

WORKFLOW = ".github/workflows/relay.yml"
CRON = "*/15 * * * *"  # a tick that finds a session running returns in about a second (docs/benchmarks.md)
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{2,49}$")  # relay.shared.spec's rule for `name:`
# The actions the workflow runs, pinned by commit (a tag can be moved to other code; a commit cannot), with
# the tag each was at. From the public record: `git show-ref --tags` in clones of github.com/actions/checkout and
# github.com/actions/setup-python, their newest release tags, read 2026-11-29. To update: the new tag's commit.
ACTIONS = {
    "checkout": ("actions/checkout", "3d3c42e5aac5ba805825da76410c181273ba90b1", "v7.0.1"),
    "setup-python": ("actions/setup-python", "5fda3b95a4ea91299a34e894583c3862153e4b97", "v7.0.0"),
}


@dataclass
class InitFiles:
    """What `relay init` writes: {path relative to the repository: text}, and files copied into it."""
    root: Path
    texts: dict[str, str] = field(default_factory=dict)
    copies: dict[str, Path] = field(default_factory=dict)
    install: str = ""  # the pip requirement the workflow installs
    notes: list[str] = field(default_factory=list)  # what the user should know of it (e.g. a commit to push)
    draft: str = ""  # the spec as if at the root, for the front door's check before anything is written

    def paths(self) -> list[str]:
        return [*self.texts, *self.copies]


def plan(root: Path, entry: str, version: str, name: Optional[str] = None, spec: str = "spec.yaml",
         wheel: Optional[Path] = None, git: Optional[str] = None,
         checkout: Path = install_source.RUNNING_CHECKOUT) -> InitFiles:
    """The files for `root` (nothing written yet); InputError, one line, for a bad option or an existing file.
    Without `wheel` or `git` the workflow installs the kaggle-relay imported from `checkout`, pinned."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"PATH: {root} is not a folder (the root of the repository to relay from)")
    if not entry or not entry.strip():
        raise InputError("--entry: empty (a script with arguments, e.g. 'train.py --lr 3e-4', a notebook"
                         " 'train.ipynb', or 'module:function')")
    if wheel is not None and git is not None:
        raise InputError("--wheel, --git: give one (where the workflow installs kaggle-relay from)")
    name = name or _name_from(root)
    if not _NAME.match(name):
        raise InputError(f"--name: {name!r} is not a relay name ([a-z0-9-], 3-50 characters, starting with a"
                         " letter or digit)")
    spec_path = Path(spec)
    if spec_path.is_absolute() or ".." in spec_path.parts or spec_path.suffix not in (".yaml", ".yml"):
        raise InputError(f"--spec: {spec} must be a .yaml path inside the repository (e.g. spec.yaml)")
    files = InitFiles(root)
    files.texts[spec_path.as_posix()] = spec_text(name, entry.strip(), version, spec_path)
    files.draft = spec_text(name, entry.strip(), version, Path(spec_path.name))
    pin = install_source.from_wheel(Path(wheel), version) if wheel is not None else None
    existing = [p for p in [*files.texts, WORKFLOW, *(pin.copies if pin else ())] if (root / p).exists()]
    if existing:
        raise InputError(f"{existing[0]}: already exists in {root}; relay init writes only new files (move it"
                         " away, or pick another --spec)")
    if pin is None:
        pin = install_source.from_git(git, version) if git is not None else install_source.running(version, checkout)
    files.install, files.copies, files.notes = pin.requirement, pin.copies, pin.notes
    files.texts[WORKFLOW] = workflow_text(name, spec_path.as_posix(), files.install, version)
    return files


def write(files: InitFiles) -> list[str]:
    """Write the planned files (their folders made as needed); the paths written, relative to the root."""
    for rel, text in files.texts.items():
        (files.root / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(files.root / rel, "x", encoding="utf-8") as out:  # "x": never over a file made meanwhile
            out.write(text)
    for rel, source in files.copies.items():
        (files.root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, files.root / rel)
    return files.paths()


def _name_from(root: Path) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", root.resolve().name.lower()).strip("-")[:50].strip("-")
    return name if len(name) >= 3 else f"relay-{name}".strip("-")


def spec_text(name: str, entry: str, version: str, spec_path: Path) -> str:
    folder = "/".join([".."] * (len(spec_path.parts) - 1)) or "."
    return f"""\
# {name}: `{entry}` relayed over quota-sized Kaggle sessions with exact resume (written by `relay init`,
# kaggle-relay {version}). Your code opens a session with the Session API (docs/your-code.md: open_session,
# register, restore, batches, step_done, close). Before spending quota:
#   relay verify-resume {spec_path.as_posix()} --steps 60     # on CPU: split runs end bit-identical to a straight one
#   relay doctor {spec_path.as_posix()}                       # credentials, quota, a CPU canary kernel
# Every key is in kaggle-relay's docs/reference/spec.md.
name: {name}
code:
  folder: {folder}            # shipped with every session (at most 2 MB; hidden files never ship)
  entry: {json.dumps(entry)}
  exclude: []           # data and weights: ship them as datasets (kaggle.dataset_sources), not as code
seed: 0
optim:
  max_steps: 1000       # the run's length in optimizer steps (session.total_steps in your code)
session:
  save_every: 10m       # an insurance checkpoint this often, beside the save before each session's end
kaggle:
  dataset_sources: []   # owner/slug of datasets your code reads (mounted in every session)
  pip: []               # packages the Kaggle image lacks (installed at a session's start; needs enable_internet)
"""


def workflow_text(name: str, spec: str, install: str, version: str) -> str:
    return f"""\
# Relay {name} on Kaggle: one tick every 15 minutes (written by `relay init`, kaggle-relay {version}).
# A tick observes Kaggle, does what needs no waiting (hand a finished session's checkpoint over, then push the
# next session) and exits: no job waits for a Kaggle session (up to 12 h; a GitHub-hosted job lasts at most 6 h).
# Kaggle is the relay's only state: nothing is kept between jobs. `relay status {name}` shows it from anywhere.
# Secrets (Settings > Secrets and variables > Actions): KAGGLE_USERNAME and KAGGLE_KEY (Kaggle > Settings > API).
# GitHub runs schedules on the default branch only, may start them late, and turns them off after 60 days
# without activity in the repository; a late tick only delays the next step.
name: relay

on:
  schedule:
    - cron: "{CRON}"
  workflow_dispatch:

permissions:
  contents: read

# One tick at a time: a late one waits for the one before instead of racing it.
concurrency:
  group: relay-{name}
  cancel-in-progress: false

jobs:
  tick:
    name: tick
    runs-on: ubuntu-latest
    timeout-minutes: 60       # a hand-over downloads a session's output and publishes a checkpoint dataset
    env:
      RELAY_SPEC: {spec}
      RELAY_PACKAGE: {json.dumps(install)}
      RELAY_VERSION: {json.dumps(version)}
      PREFECT_SERVER_ANALYTICS_ENABLED: "false"
      DO_NOT_TRACK: "1"
    steps:
      - uses: {_uses("checkout")}
        with:
          persist-credentials: false   # no token left in .git/config for the steps after it

      - uses: {_uses("setup-python")}
        with:
          python-version: "3.11"

      # The orchestrator only (no torch): a tick that only waits imports no Prefect either.
      - name: Install kaggle-relay {version}
        run: |
          python -m pip install -q "$RELAY_PACKAGE"
          installed="$(python -c 'import relay; print(relay.__version__)')"
          if [ "$installed" != "$RELAY_VERSION" ]; then
            echo "::error::kaggle-relay $installed came from $RELAY_PACKAGE; this workflow pins $RELAY_VERSION"
            exit 1
          fi

      - name: Tick the relay
        env:
          KAGGLE_USERNAME: ${{{{ secrets.KAGGLE_USERNAME }}}}
          KAGGLE_KEY: ${{{{ secrets.KAGGLE_KEY }}}}
          PREFECT_HOME: ${{{{ runner.temp }}}}/prefect
          RELAY_STATE_DIR: ${{{{ runner.temp }}}}/relay   # a cache only: the relay rebuilds its state from Kaggle
        run: |
          if [ -z "$KAGGLE_USERNAME" ] || [ -z "$KAGGLE_KEY" ]; then
            echo "::error::set the repository secrets KAGGLE_USERNAME and KAGGLE_KEY"
            exit 1
          fi
          set -o pipefail
          relay run "$RELAY_SPEC" --tick --out "$RELAY_STATE_DIR" | tee -a "$GITHUB_STEP_SUMMARY"
"""


def _uses(action: str) -> str:
    repo, commit, tag = ACTIONS[action]
    return f"{repo}@{commit} # {tag}"
