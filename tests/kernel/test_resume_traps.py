"""Issue 45's traps, each as a user script met them: the work a loop does after its last step_done (an eval
drawing from the global RNG), the relay's own outputs shipped as code, verify-resume's cut points and its
`why:` for a DataLoader's seed draw (the flow log's eval step: tests/orchestrator/test_live.py).

Sessions are bounded by step counts (`--max-steps`), never by time.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

# what both scripts below start with: a session, data, a model with dropout (it draws from the global RNG)
SCRIPT_START = '''
import torch, relay
from torch.utils.data import DataLoader, TensorDataset
session = relay.open_session()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(model=model, optimizer=opt)
'''

# 64 samples of 8: an epoch is 8 steps. At each epoch end, after step_done, an eval iterates a DataLoader
# without generator=: its iterator draws a base seed from the global RNG, which the dropout of the next
# step draws from too. save_every is tiny, so an insurance save is due at every step, the last included.
EVAL_AT_EPOCH_ENDS = SCRIPT_START + '''session.restore()
for idx in session.batches(64, 8):
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(); loss.backward(); opt.step()
    session.step_done(loss=loss.detach())
    if session.step % 8 == 0:  # the epoch's end
        model.eval()
        with torch.no_grad():
            val = sum(float(model(b).sum()) for (b,) in DataLoader(TensorDataset(x), batch_size=16))
        model.train()
        session.log("eval", val=val)
session.close()
'''


def write_script_spec(folder: Path, script: str, **session) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(script)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "traps", "code": {"folder": ".", "entry": "train.py"}, "seed": 0,
        "optim": {"max_steps": 24, "log_every_steps": 4},
        "session": {"threads": 1, "save_every": "0.001s", **session}}, sort_keys=False))
    return spec


def progress(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


def test_an_eval_after_the_last_steps_insurance_save_is_in_the_sessions_checkpoint(relay_cli, tmp_path):
    spec = write_script_spec(tmp_path / "code", EVAL_AT_EPOCH_ENDS)
    split, straight = tmp_path / "split", tmp_path / "straight"
    for _ in range(3):  # sessions cut at the epoch ends: 8 steps each
        out = relay_cli.run(*relay_cli.train_args(spec, split, None, "--max-steps", "8"))
        assert out.returncode == 0, out.stderr[-3000:]
    out = relay_cli.run(*relay_cli.train_args(spec, straight, None, "--max-steps", "none"))
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = progress(split), progress(straight)
    assert [s["step_end"] for s in a["sessions"]] == [8, 16, 24] and a["status"] == b["status"] == "done"
    assert a["weights_sha256"] == b["weights_sha256"]


# -- the relay's own outputs never ship as code ------------------------------------------------------------
def _shipped(spec_path: Path) -> list[str]:
    import io
    import zipfile

    from relay.orchestrator.kaggle.bundle import build_bundle
    from relay.shared import spec as spec_mod

    spec = spec_mod.load(spec_path)
    bundle = build_bundle(user_code=spec.code.folder, exclude=spec.code.exclude)
    return sorted(n.removeprefix("user-code/") for n in zipfile.ZipFile(io.BytesIO(bundle.data)).namelist()
                  if n.startswith("user-code/"))


def test_the_relays_output_folders_beside_the_spec_do_not_ship(tmp_path):
    from byo_fixtures import copy_example
    from relay.shared.code_folder import mark_outputs

    spec = copy_example("byo-plain", tmp_path / "ex")
    code = spec.parent
    before = _shipped(spec)
    big = b"x" * 400_000  # three of them would pass the 2 MB a kernel carries
    for run_folder in ("relay-runs/byo-plain", "runs/byo-plain", "relay-run/checkpoints", "my-out/byo-plain"):
        (code / run_folder).mkdir(parents=True)
        (code / run_folder / "state.pt").write_bytes(big)
        (code / run_folder / "progress.json").write_text("{}")
    mark_outputs(code / "my-out")  # `relay run --out my-out`: whatever it is named
    (code / "pkg" / "runs").mkdir(parents=True)  # a package's own runs/ below the top is code
    (code / "pkg" / "runs" / "a.py").write_text("x = 1\n")
    assert _shipped(spec) == sorted([*before, "pkg/runs/a.py"])


def test_accelerates_own_save_state_folders_never_ship_and_loading_the_spec_says_so_in_one_line(tmp_path, caplog):
    """Accelerate's by_feature/checkpointing.py with --checkpointing_steps epoch writes epoch_0/ into the current
    folder, the code folder: left out of what ships (the relay's checkpoint carries that state), in one line."""
    import logging

    from byo_fixtures import copy_example

    spec = copy_example("byo-plain", tmp_path / "ex")
    before = _shipped(spec)
    for name, files in {"epoch_0": ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"),
                        "out/step_8": ("pytorch_model.bin", "random_states_0.pkl", "random_states_1.pkl"),
                        "mine": ("random_states_0.pkl", "notes.txt")}.items():  # no weights beside it: code
        (spec.parent / name).mkdir(parents=True)
        for f in files:
            (spec.parent / name / f).write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING, logger="relay.shared.spec"):
        assert _shipped(spec) == sorted([*before, "mine/notes.txt", "mine/random_states_0.pkl"])
    lines = [r.getMessage() for r in caplog.records if r.name == "relay.shared.spec"]
    assert lines == ["code.folder: epoch_0/, out/step_8/ are Accelerate's save_state output, left out of what ships"
                     " (the relay's checkpoint carries that state): save it under session.workdir, or delete it"], lines


def test_a_code_folder_inside_the_relays_outputs_is_refused_in_one_line(tmp_path):
    from relay.shared import spec as spec_mod
    from relay.shared.errors import InputError

    inner = tmp_path / "relay-runs" / "byo-plain" / "code"
    inner.mkdir(parents=True)
    (inner / "train.py").write_text("print(1)\n")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "traps", "code": {"folder": "relay-runs/byo-plain/code", "entry": "train.py"},
                                    "optim": {"max_steps": 10}}))
    try:
        spec_mod.load(path)
    except InputError as err:
        message = str(err)
    else:
        raise AssertionError("a code folder inside relay-runs/ was accepted")
    assert "\n" not in message and ": code.folder: " in message and "relay's output folder" in message, message


# -- relay verify-resume: where it cuts, and why a run differs ---------------------------------------------
def test_verify_resume_cuts_at_the_epoch_ends_and_log_steps_by_default(relay_cli, tmp_path):
    """The eval-at-epoch-ends script: verify-resume's default cuts include the epoch ends, where the trap of
    the first test lives; it says which steps it cut at."""
    spec = write_script_spec(tmp_path / "code", EVAL_AT_EPOCH_ENDS)
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical"), out.stdout
    cuts = out.stdout.split("cut at steps ", 1)[1].splitlines()[0]
    assert "8 (epoch end)" in cuts and "16 (epoch end)" in cuts and "4 (log step)" in cuts, cuts
    assert "(killed mid-save)" in out.stdout


def test_verify_resume_cut_at_must_be_steps_inside_the_run(relay_cli, tmp_path):
    spec = write_script_spec(tmp_path / "code", EVAL_AT_EPOCH_ENDS)
    for bad in ("8,x", "0", "24"):
        out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--cut-at", bad,
                            "--workdir", str(tmp_path / "v"))
        assert out.returncode == 2 and not (tmp_path / "v" / "straight").exists(), out.stdout + out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "--cut-at" in lines[0], out.stderr


# Accelerate's idiom: a shuffling DataLoader without generator=, resumed by skipping the epoch's first batches
# (accelerate's skip_first_batches). Each new iterator draws its seed and its order from the global RNG: the
# resumed session's iterator, made at the resume step, shuffles otherwise than the straight run's.
SKIPPING_BATCHES = SCRIPT_START + '''start = session.restore()
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
skip = start % len(loader)
while not session.should_stop():
    for i, (xb, yb) in enumerate(loader):
        if i < skip:
            continue
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(); loss.backward(); opt.step()
        session.step_done(loss=loss.detach(), samples=len(xb))
        if session.should_stop():
            break
    skip = 0
session.close()
'''


def test_verify_resume_names_a_dataloader_iterator_drawing_its_seed_from_the_global_rng(relay_cli, tmp_path):
    spec = write_script_spec(tmp_path / "code", SKIPPING_BATCHES)
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--cut-at", "5,13",
                        "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "cut at steps 5 (--cut-at), 13 (--cut-at)" in out.stdout, out.stdout
    why = out.stdout.split("why: ", 1)[1]
    assert why.startswith("step 5 (the first after a resume): train.py:"), why
    assert "iterates a DataLoader without generator=" in why and "the split run made one at step 5" in why, why
    assert "generator=torch.Generator()" in why and "session.batch_sampler" in why, why
    assert "prefetched" not in why, why
