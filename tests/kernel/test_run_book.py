"""One book for both session paths (relay.kernel.session.books.RunBook): the built-in loop drives a Session as a
user's loop does, so what each saves and reports is the same format, read and written in one place."""
from __future__ import annotations

import torch

from conftest import load_toy_spec
from relay.kernel.run import run_session
from relay.kernel.session import books, checkpoint
from relay.kernel.session.api import Session
from relay.kernel.session.settings import SessionSettings


def user_loop(workdir, steps: int, *, total: int = 8, background: bool = False) -> Session:
    """A script's loop of `steps` steps on a 16-sample set in batches of 4 (4 steps an epoch), one save on the way."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session(SessionSettings(total_steps=total, workdir=str(workdir), save_every=1e9))
    session.register(model=model, optimizer=opt)
    session.restore()
    for idx in session.batches(16, 4):
        x = torch.tensor([[float(i), 1.0, -1.0] for i in idx])
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        session.step_done(loss=loss.detach())
        if session.step == 2:
            assert session.save("manual", background=background) is None or not background
        if session.step == steps:
            break
    return session


def test_a_user_loop_checkpoint_holds_the_book_without_the_built_in_loop_keys(tmp_path):
    session = user_loop(tmp_path / "w", steps=3)
    session.close()
    saved = books.current_layout(checkpoint.load(checkpoint.list_valid(tmp_path / "w" / "checkpoints")[0]))
    assert saved["relay"]["global_step"] == 3 and saved["relay"]["world_size"] == 1
    assert not {"micro_batch", "grad_accum", "precision"} & set(saved["relay"])  # the script picks its own
    assert books.RunBook.from_dict(saved["relay"]).sessions[0]["step_end"] == 3


def test_the_built_in_loop_checkpoint_holds_the_same_book_with_its_batch_split(tmp_path):
    spec = load_toy_spec(**{"session.max_steps": 3})
    run_session(spec, tmp_path / "w")
    saved = books.current_layout(checkpoint.load(checkpoint.list_valid(tmp_path / "w" / "checkpoints")[0]))
    book = books.RunBook.from_dict(saved["relay"])
    assert book.global_step == 3 and book.micro_batch == spec.optim.micro_batch and book.precision == "fp32"
    assert set(saved["objects"]) == {"model", "optimizer", "scheduler", "scaler"}  # the layout it always saved


def test_both_paths_report_the_epoch_of_the_last_step_taken(tmp_path):
    """progress.json's epoch and the checkpoint's: a session that stops at an epoch's end reports the epoch it
    finished, not the one its next step would start (the Trainer always did; the Session API said the next)."""
    session = user_loop(tmp_path / "user", steps=4)
    progress = session.close()
    assert progress["global_step"] == 4 and progress["steps_per_epoch"] == 4 and progress["epoch"] == 0
    assert checkpoint.list_valid(tmp_path / "user" / "checkpoints")[0].step == 4
    assert session.epoch == 1  # what a script's next step is in: its data follow it

    per_epoch = run_session(load_toy_spec(**{"session.max_steps": 1}), tmp_path / "probe")["steps_per_epoch"]
    built_in = run_session(load_toy_spec(**{"session.max_steps": per_epoch}), tmp_path / "builtin")
    assert built_in["global_step"] == per_epoch and built_in["epoch"] == 0


def test_a_user_loop_may_save_in_the_background_and_close_waits_for_it(tmp_path):
    session = user_loop(tmp_path / "w", steps=5, background=True)
    progress = session.close()
    steps = sorted(c.step for c in checkpoint.list_valid(tmp_path / "w" / "checkpoints"))
    assert steps == [2, 5] and progress["global_step"] == 5 and progress["status"] == "paused"


def test_the_book_scores_an_eval_against_the_best_so_far():
    book = books.RunBook(global_step=10)
    assert book.score("smape", "min", 30.0) and book.best == {"metric": "smape", "value": 30.0, "step": 10,
                                                               "mode": "min"}
    book.global_step = 20
    assert not book.score("smape", "min", 31.0) and not book.score("smape", "min", float("nan"))
    assert not book.score("smape", "min", None) and book.best["step"] == 10
    assert book.score("smape", "min", 29.0) and book.best["step"] == 20
    assert books.RunBook().score("acc", "max", 0.5) and not books.RunBook(best={"value": 0.9}).score("acc", "max", 0.5)
