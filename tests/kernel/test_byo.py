"""Bring your own code: the Session API, user recipes, `code:` specs, bad inputs and `relay verify-resume`.

The proofs run the examples under examples/byo-* in real `relay train` processes; session lengths are step
counts and the kill in verify-resume is triggered by a save's state file appearing, never by a timer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from byo_fixtures import copy_example

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def progress(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


# -- the Session API over several step-bounded sessions --------------------------------------------------
@pytest.mark.parametrize("example", ["byo-plain"])  # byo-recipe: relayed in test_byo_relay.py, verified below
def test_three_sessions_end_with_the_weights_of_one(example, relay_cli, tmp_path):
    spec = copy_example(example, tmp_path / example)
    split, straight = tmp_path / "split", tmp_path / "straight"
    for _ in range(3):
        relay_cli.train(spec, split)
    relay_cli.train(spec, straight, None, "--max-steps", "none")
    a, b = progress(split), progress(straight)
    assert a["status"] == b["status"] == "done" and a["global_step"] == b["global_step"]
    assert [s["stop_reason"] for s in a["sessions"]] == ["steps", "steps", "done"]
    assert a["weights_sha256"] == b["weights_sha256"]
    if example == "byo-plain":  # the Session API writes what the session table and plots read
        records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
        assert {r["session"] for r in records} == {1, 2, 3}
        assert [r["step"] for r in records if r["kind"] == "train"] == list(range(10, 301, 10))
        assert (split / "export" / "model.safetensors").is_file()
        assert relay_cli.run("status", str(split)).returncode == 0


def test_sigterm_sets_a_flag_and_the_session_saves_at_the_next_step(relay_cli, tmp_path):
    spec = copy_example("byo-plain", tmp_path / "ex", **{"session.max_steps": None, "optim.max_steps": 10**6})
    workdir = tmp_path / "w"
    proc = relay_cli.popen("train", str(spec), "--workdir", str(workdir))
    import signal
    import time

    deadline = time.monotonic() + 120
    while not (workdir / "metrics.jsonl").exists():  # training has started: some step was logged
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, proc.communicate()
    p = progress(workdir)
    assert p["status"] == "paused" and p["stop_reason"] == "sigterm" and p["global_step"] > 0
    assert p["checkpoint"].endswith(f"step-{p['global_step']:08d}")


# -- bad inputs: one line, exit 2, nothing written ---------------------------------------------------------
def _bad(tmp_path: Path, files: dict, spec: dict) -> tuple[Path, dict]:
    folder = tmp_path / "code"
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    base = {"name": "byo-bad", "code": {"folder": "code"}, "optim": {"max_steps": 10}, "session": {"threads": 1}}
    base.update(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(base))
    return path, base


USER_PARAMS = ("from relay import Recipe, RecipeParams\n\n\nclass P(RecipeParams):\n    hidden: int = 4\n\n\n"
               "class Mine(Recipe):\n    Params = P\n")
BAD = {
    "recipe does not import": ({"mypkg/__init__.py": "", "mypkg/r.py": "import not_a_module_anywhere\n"},
                               {"recipe": "mypkg.r:Mine"}, "recipe: cannot import mypkg.r (ModuleNotFoundError"),
    "entry needs a package, no kaggle.pip": ({"pkgp/__init__.py": "import not_a_module_anywhere\n", "pkgp/m.py": ""},
                                            {"code": {"folder": "code", "entry": "pkgp.m:main"}},
                                            "code.entry: module pkgp.m not found in"),
    "class is not a Recipe": ({"pkgb/__init__.py": "", "pkgb/r2.py": "class Mine:\n    pass\n"},
                              {"recipe": "pkgb.r2:Mine"}, "recipe: pkgb.r2:Mine is not a Recipe"),
    "entry does not exist": ({"train.py": "print(1)\n"}, {"code": {"folder": "code", "entry": "trian.py --x 1"}},
                             "code.entry: trian.py not found in"),
    "entry module does not exist": ({"train.py": "print(1)\n"}, {"code": {"folder": "code", "entry": "nope.mod:main"}},
                                    "code.entry: module nope.mod not found in"),
    "code over the size limit": ({"train.py": "print(1)\n", "weights.bin": "x" * 2_100_000},
                                 {"code": {"folder": "code", "entry": "train.py"}},
                                 "code.folder: ", ),
    "script never opens a session": ({"train.py": "print('training without the relay')\n"},
                                     {"code": {"folder": "code", "entry": "train.py"}},
                                     "code.entry train.py: ended without opening a relay session"),
    "user recipe params: unknown key": ({"pkgc/__init__.py": "", "pkgc/r.py": USER_PARAMS},
                                        {"recipe": "pkgc.r:Mine", "params": {"hidden": 4, "bogus": 1}},
                                        "params.bogus: unknown key"),
    "user recipe params: wrong type": ({"pkgd/__init__.py": "", "pkgd/r.py": USER_PARAMS},
                                       {"recipe": "pkgd.r:Mine", "params": {"hidden": "x"}},
                                       "params.hidden: Input should be a valid integer (got 'x')"),
    "pip without internet": ({"train.py": "print(1)\n"},
                             {"code": {"folder": "code", "entry": "train.py"}, "kaggle": {"pip": ["einops"]}},
                             "kaggle.pip: installing requirements at kernel start needs kaggle.enable_internet"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_user_code_is_one_line_exit_2_nothing_written(case, tmp_path, capsys, monkeypatch):
    from relay.cli import main

    files, spec, expected = BAD[case]
    path, _ = _bad(tmp_path, files, spec)
    workdir = tmp_path / "work"
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # check_spec puts code.folder on it
    assert main(["train", str(path), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert expected in err, err
    if case == "code over the size limit":
        assert "2 MB travel inside the session kernel" in err and "code.exclude" in err
    if "not_a_module_anywhere" in str(files):  # the missing package named, and where to list it
        assert "'not_a_module_anywhere'" in err and "list it in kaggle.pip" in err, err
    assert not workdir.exists()


PIP_ONLY = "import not_installed_here_xyz\nfrom relay import Recipe\n\nclass Mine(Recipe):\n    pass\n"


@pytest.mark.parametrize("spec", [{"recipe": "pkgq.r:Mine", "params": {"anything": 1}},
                                  {"code": {"folder": "code", "entry": "pkgq.r:main"}}])
def test_user_code_needing_a_kaggle_pip_package_loads_in_the_orchestrator(spec, tmp_path, monkeypatch):
    """The orchestrator never pip-installs: a module importing what kaggle.pip provides is checked for its file
    only, and the Recipe/Params check happens in the kernel's `relay train`, after pip."""
    from relay.front_door import load_spec  # the spec, then the user's code it names
    from relay.shared import spec as spec_mod

    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    kaggle = {"pip": ["not-installed-here-xyz"], "enable_internet": True}
    path, _ = _bad(tmp_path, {"pkgq/__init__.py": PIP_ONLY, "pkgq/r.py": PIP_ONLY}, {**spec, "kaggle": kaggle})
    assert load_spec(path).kaggle.pip == ["not-installed-here-xyz"]
    # the module file itself must still exist
    wrong = {k: (v.replace("pkgq.r", "pkgq.nope") if isinstance(v, str) else v) for k, v in spec.items()}
    if "code" in wrong:
        wrong["code"] = {"folder": "code", "entry": "pkgq.nope:main"}
    path, _ = _bad(tmp_path, {}, {**wrong, "kaggle": kaggle})
    with pytest.raises(spec_mod.SpecError, match="pkgq.nope"):
        load_spec(path)


def test_loading_a_user_recipe_writes_nothing_in_its_folder(tmp_path, monkeypatch):
    from relay.front_door import load_spec  # the spec, then the user's code it names

    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.setattr("sys.dont_write_bytecode", False)  # as for a user without PYTHONDONTWRITEBYTECODE
    spec = copy_example("byo-recipe", tmp_path / "ex")
    before = sorted(p.relative_to(spec.parent) for p in spec.parent.rglob("*"))
    load_spec(spec)
    assert sorted(p.relative_to(spec.parent) for p in spec.parent.rglob("*")) == before
    assert __import__("sys").dont_write_bytecode is False  # put back after the import


def test_code_exclude_and_hidden_files_do_not_ship(tmp_path):
    from relay.orchestrator.kaggle.bundle import build_bundle
    import io
    import zipfile

    path, _ = _bad(tmp_path, {"train.py": "x", "data/big.bin": "x" * 2_100_000, ".git/HEAD": "x",
                              "pkg/__pycache__/a.pyc": "x", "relay-run/progress.json": "{}"},
                   {"code": {"folder": "code", "entry": "train.py", "exclude": ["data"]}})
    from relay.shared import spec as spec_mod

    spec = spec_mod.load(path)
    bundle = build_bundle(user_code=spec.code.folder, exclude=spec.code.exclude)
    names = [n for n in zipfile.ZipFile(io.BytesIO(bundle.data)).namelist() if n.startswith("user-code/")]
    assert names == ["user-code/train.py"]
    assert bundle.code_version == build_bundle().code_version  # the relay's own code names the version


# -- relay verify-resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["byo-recipe"])  # byo-plain: relayed with a kill in test_byo_relay.py
def test_verify_resume_says_identical(example, relay_cli, tmp_path):
    spec = copy_example(example, tmp_path / example)
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical"), out.stdout
    assert "(killed mid-save)" in out.stdout
    import torch

    from relay.kernel.session import hardware
    # both runs ran here: the machine it proved exactness on, and that other CPUs/GPUs are not promised it
    assert (f"machine: CPU {hardware.cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), " in out.stdout
            and "is not promised bit-identity across them" in out.stdout), out.stdout
    torn = list((tmp_path / "v" / "split" / "checkpoints").glob(".tmp-step-*"))
    assert (tmp_path / "v" / "killed").is_file()  # the kill happened inside a save, after its state file
    assert not torn or all(not (t / "manifest.json").exists() for t in torn)


def test_verify_resume_names_the_state_a_script_forgets(relay_cli, tmp_path):
    """The same loop without the scheduler registered: the split run restarts the lr schedule each session."""
    spec = copy_example("byo-plain", tmp_path / "ex")
    script = tmp_path / "ex" / "train.py"
    script.write_text(script.read_text().replace("optimizer=opt, scheduler=sched,", "optimizer=opt,"))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("differs: objects.model.") and "max |diff|" in first, out.stdout
    why = out.stdout.split("why: ", 1)[1]
    assert why.startswith("step ") and "(inside a session): " in why and "optimizer" in why.split(" at the")[0], why
    assert "sched (LambdaLR)" in why and "session.register(sched=sched)" in why, why


def test_verify_resume_names_the_step_where_a_prefetched_batch_breaks_exactness(relay_cli, tmp_path):
    """The loop draws the next step's batch from the global RNG one step ahead: a resumed session draws it
    again, so the first step after each resume trains on another batch. verify-resume names that step."""
    spec = copy_example("byo-plain", tmp_path / "ex")
    script = tmp_path / "ex" / "train.py"
    script.write_text(script.read_text().replace(
        "    for idx in session.batches(len(x), args.batch):  # relay: this step's samples, until it must stop\n",
        "    nxt = torch.randint(len(x), (args.batch,))  # a prefetched batch\n"
        "    for _ in session.batches(len(x), args.batch):\n"
        "        idx, nxt = nxt, torch.randint(len(x), (args.batch,))\n"))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    why = out.stdout.split("why: ", 1)[1]
    first_resume = int(out.stdout.split("sessions 0->", 1)[1].split(",")[0])
    assert why.startswith(f"step {first_resume} (the first after a resume): the RNG state at the step's start"
                          " differs, although restore() brought back the straight run's: the script draws random"
                          " numbers after restore(), before its first step"), out.stdout
    assert "a prefetched batch" in why, why


# -- the HF callback refuses what cannot resume -------------------------------------------------------------
@pytest.mark.parametrize("setting, expected", [
    ({"save_total_limit": 2}, "TrainingArguments.save_total_limit: the relay keeps checkpoints"),
    ({"save_only_model": True}, "TrainingArguments.save_only_model=True: a checkpoint without optimizer"),
    ({"ignore_data_skip": True}, "TrainingArguments.ignore_data_skip=True"),
    ({"max_steps": 7}, "TrainingArguments.max_steps=7: set it to session.total_steps (10)"),
])
def test_hf_callback_refuses_configs_that_cannot_resume(setting, expected, tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import relay
    from relay.hf import RelayCallback
    from relay.shared.errors import InputError

    session = relay.open_session(total_steps=10, workdir=str(tmp_path / "w"))
    try:
        callback = RelayCallback(session)
        assert callback.restore() is None
        args = TrainingArguments(**{"output_dir": str(tmp_path / "hf"), "max_steps": 10, "report_to": [],
                                    "use_cpu": True, **setting})
        with pytest.raises(InputError) as err:
            callback.on_train_begin(args, TrainerState(), TrainerControl(), model=None)
        assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    finally:
        session.clock.restore_signal_handlers()


# -- the save the clock plans for includes the trainer's own checkpoint write ------------------------------
@pytest.fixture
def fake_clock(monkeypatch):
    """time.perf_counter as a value the test advances: a trainer's write "takes" 30 s, deterministically."""
    import time

    now = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def test_hf_save_time_counts_from_the_trainers_write(fake_clock, tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import relay
    from relay.hf import RelayCallback

    session = relay.open_session(total_steps=10, workdir=str(tmp_path / "w"))
    try:
        callback = RelayCallback(session)
        callback.restore()
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=10, report_to=[], use_cpu=True)
        state, control = TrainerState(global_step=1), TrainerControl()
        session.clock.stop_signal = "SIGTERM"  # this step ends the session: save and stop
        control = callback.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop
        folder = tmp_path / "hf" / "checkpoint-1"  # the Trainer writes its checkpoint: 30 s
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        fake_clock[0] += 30.0
        callback.on_save(args, state, control)
        assert session.clock.save_seconds == pytest.approx(30.0)
    finally:
        session.clock.restore_signal_handlers()


def test_lightning_save_time_counts_from_the_trainers_write(fake_clock, tmp_path):
    from types import SimpleNamespace

    import relay
    from relay.lightning import RelayLightningCallback

    session = relay.open_session(total_steps=10, workdir=str(tmp_path / "w"))
    try:
        callback = RelayLightningCallback(session)
        callback.restore()

        def save_checkpoint(path):  # Lightning's write: 30 s
            Path(path).write_bytes(b"x" * 100)
            fake_clock[0] += 30.0

        trainer = SimpleNamespace(global_step=1, should_stop=False, save_checkpoint=save_checkpoint)
        session.clock.stop_signal = "SIGTERM"
        callback.on_train_batch_end(trainer, None, {"loss": 1.0}, None, 0)
        assert trainer.should_stop and session.clock.save_seconds == pytest.approx(30.0)
    finally:
        session.clock.restore_signal_handlers()


def test_session_saves_count_the_rest_of_the_workdir_against_the_disk_budget(tmp_path):
    """hf-resume/, lightning-resume/, a Trainer's folder and export/ share Kaggle's output cap with the checkpoints."""
    import torch

    import relay
    from relay.kernel.session import checkpoint

    workdir = tmp_path / "w"
    session = relay.open_session(total_steps=10, workdir=str(workdir), keep_last=5)
    try:
        session.register(model=torch.nn.Linear(256, 256))
        session.restore()
        session.step = 1
        size = session.save("periodic").nbytes()
        # three checkpoints fit, but not beside the copy (the size is known only after a save)
        session.core.checkpoints = session.core.checkpoints.model_copy(update={"disk_budget_gb": 4.5 * size / 1e9})
        (workdir / "hf-resume" / "checkpoint").mkdir(parents=True)
        (workdir / "hf-resume" / "checkpoint" / "model.safetensors").write_bytes(b"x" * (2 * size))
        for step in (2, 3):
            session.step = step
            session.save("periodic")
        kept = checkpoint.list_valid(workdir / "checkpoints")
        assert [c.step for c in kept] == [3, 2]
        assert sum(c.nbytes() for c in kept) + 2 * size <= 4.5 * size
    finally:
        session.clock.restore_signal_handlers()


def test_make_bench_reports_the_session_api_overhead(tmp_path, capsys):
    """bench/run.py runs bench_byo like the other benches: flat byo_* figures, a target, a printed line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)
    assert "byo" in bench_run.BENCHES
    module, full, quick = bench_run.BENCHES["byo"]  # --quick smaller still: 1 round of 2 turns (not 3 of 4)
    bench_run.BENCHES["byo"] = (module, full, {**quick, "steps": 50, "repeats": 1})
    bench_run.main(["--only", "byo", "--quick", "--out", str(tmp_path / "results.json")])
    figures = json.loads((tmp_path / "results.json").read_text())["figures"]
    assert figures["byo_target_overhead"] == 1.03 and figures["byo_session_over_plain"] > 0
    assert "byo_meets_target" in figures and "Session API overhead" in capsys.readouterr().out


def test_hf_callback_refuses_an_iterable_train_set(tmp_path):
    """A stream cannot be skipped to a step, so a resumed session would not see the batches it should (HF #26413)."""
    from torch.utils.data import DataLoader, IterableDataset
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import relay
    from relay.hf import RelayCallback
    from relay.shared.errors import InputError

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(100))

    session = relay.open_session(total_steps=10, workdir=str(tmp_path / "w"))
    try:
        callback = RelayCallback(session)
        callback.restore()
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=10, report_to=[], use_cpu=True)
        with pytest.raises(InputError) as err:
            callback.on_train_begin(args, TrainerState(), TrainerControl(), model=None,
                                    train_dataloader=DataLoader(Stream(), batch_size=2))
        assert str(err.value).startswith("train_dataset: an IterableDataset cannot resume exactly")
        assert "\n" not in str(err.value)
    finally:
        session.clock.restore_signal_handlers()


def test_session_batch_larger_than_the_data_names_batch_size(tmp_path):
    import torch

    import relay
    from relay.shared.errors import InputError

    session = relay.open_session(total_steps=10, workdir=str(tmp_path / "w"))
    try:
        session.register(model=torch.nn.Linear(2, 2))
        session.restore()
        with pytest.raises(InputError, match=r"^batch_size \(32\) is larger than the training set \(10 samples\)$"):
            session.batch_indices(10, 32)
    finally:
        session.clock.restore_signal_handlers()


def test_a_script_reads_relative_to_its_folder_and_verify_resume_warns_about_files_it_would_lose(
        relay_cli, tmp_path):
    """`python train.py` from its own folder reads config/lr.txt; so does a session, wherever it was started.
    The script also saves a file next to itself: verify-resume says a Kaggle session would lose it."""
    spec = copy_example("byo-plain", tmp_path / "ex")
    (tmp_path / "ex" / "config").mkdir()
    (tmp_path / "ex" / "config" / "lr.txt").write_text("0.003\n")
    script = tmp_path / "ex" / "train.py"
    script.write_text(script.read_text().replace(
        '    ap.add_argument("--lr", type=float, default=3e-3)\n',
        '    ap.add_argument("--lr", type=float, default=float(open("config/lr.txt").read()))\n').replace(
        "    session.close()  # relay\n", '    torch.save(model.state_dict(), "last.pt")\n    session.close()  # relay\n'))
    try:
        out = relay_cli.run("verify-resume", str(spec), "--steps", "12", "--workdir", "v", timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert out.stdout.startswith("identical")
        assert "warning: the script wrote last.pt in its code folder" in out.stdout, out.stdout
        assert (relay_cli.cwd / "v" / "straight" / "progress.json").is_file()  # --workdir relative to the caller
    finally:  # the caller's folder is shared by every test that runs the CLI: leave it empty
        shutil.rmtree(relay_cli.cwd / "v", ignore_errors=True)
