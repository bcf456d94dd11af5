"""The VQA student (seed 002) as a relay recipe: curriculum stages resume bit-identically wherever a session ends,
the seed's OOM ladder walks in order and holds across sessions, bad inputs are one-line errors.

Sessions run in-process through run_session (one transformers import for the module). CUDA OOM cannot happen on
this CPU machine: a test recipe raises torch.cuda.OutOfMemoryError while a setting is above a "memory" limit.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, deep_merge
from relay import cli
from relay.kernel.recipes import vqa_data
from relay.kernel.recipes.vqa_student import NO_LOGIT, VQARows, VQAStudentRecipe, first_tokens
from relay.kernel.run import run_session
from relay.orchestrator import report
from relay.shared import spec as spec_mod
from relay.shared.errors import InputError

torch.set_num_threads(1)

STEPS_PER_EPOCH, EPOCHS = 4, 4  # 32 train samples at an effective batch of 8
BOUNDARY = 2 * STEPS_PER_EPOCH  # ANSWER_FOCUS -> FORMAT_LEARNING


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vqa-data")
    vqa_data.generate(out, n_train=32, n_val=12, n_test=4, image_size=32, seed=1, noise=0.1, logits_fraction=0.5)
    return out


def spec_dict(data_dir: Path, **overrides) -> dict:
    base = yaml.safe_load((REPO / "examples" / "vqa-tiny.yaml").read_text())
    base = deep_merge(base, {"params": {"data_dir": str(data_dir)}, "session": {"threads": 1}})
    return deep_merge(base, overrides)


def load(data_dir: Path, **overrides):
    return spec_mod.validate(spec_dict(data_dir, **overrides), source="test-spec")


def run_in_sessions(data_dir: Path, workdir: Path, cuts: list[int], **overrides) -> dict:
    """Sessions ending at the given global steps (session.max_steps each), then one to the end."""
    done, progress = 0, None
    for cut in [*cuts, None]:
        steps = None if cut is None else cut - done
        progress = run_session(load(data_dir, **{"session.max_steps": steps}, **overrides), workdir)
        assert progress["global_step"] == (cut if cut is not None else EPOCHS * STEPS_PER_EPOCH)
        done = progress["global_step"]
    assert progress["status"] == "done"
    return progress


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("vqa-ref")
    progress = run_session(load(data_dir), workdir)
    assert progress["status"] == "done" and progress["total_steps"] == EPOCHS * STEPS_PER_EPOCH
    return {"progress": progress, "workdir": workdir}


# -- curriculum and exact resume ------------------------------------------------------------------------
def test_uninterrupted_run_marks_the_stage_change_evaluates_and_exports(uninterrupted):
    progress, workdir = uninterrupted["progress"], uninterrupted["workdir"]
    records = report.read_metrics(workdir / "metrics.jsonl")
    assert report.stage_changes(records) == [(BOUNDARY, "FORMAT_LEARNING")]
    train = [r for r in records if r["kind"] == "train"]
    assert {r["stage"] for r in train if r["step"] <= BOUNDARY} == {"ANSWER_FOCUS"}
    assert {r["stage"] for r in train if r["step"] > BOUNDARY} == {"FORMAT_LEARNING"}
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    assert all(0.0 <= r["exact_match"] <= r["f1"] <= 1.0 for r in evals)
    assert progress["best"]["metric"] == "f1" and progress["best"]["value"] == max(r["f1"] for r in evals)
    assert progress["sessions"][0]["stage"] == "ANSWER_FOCUS -> FORMAT_LEARNING"
    export = workdir / "export"
    assert {"model.safetensors", "config.json", "predictions.jsonl", "decoder", "vision", "question",
            "answer_tokenizer", "question_tokenizer"} <= {p.name for p in export.iterdir()}
    predictions = [json.loads(line) for line in (export / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 12 + 4 and all(isinstance(p["prediction"], str) for p in predictions)


def test_loss_curve_png_draws_the_stage_change(uninterrupted, monkeypatch):
    """A dotted line at the stage change on both panels, labelled with the new stage (the figure inspected
    before it is saved; one session, so no dashed session lines)."""
    workdir, figures, save = uninterrupted["workdir"], [], report.save_figure
    monkeypatch.setattr(report, "save_figure", lambda fig, out, **kw: figures.append(fig) or save(fig, out, **kw))
    png = report.plot_curves(workdir / "metrics.jsonl", workdir / "curves.png", metric="f1", metric_mode="max")
    assert png.stat().st_size > 10_000
    ax_loss, ax_metric = figures[0].axes[:2]
    for ax in (ax_loss, ax_metric):
        dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert [tuple(line.get_xdata()) for line in dotted] == [(BOUNDARY, BOUNDARY)]
    assert "FORMAT_LEARNING" in [t.get_text() for t in ax_loss.texts]
    assert "dotted = stage changes" in figures[0]._suptitle.get_text()


def test_sessions_split_at_random_points_end_with_the_uninterrupted_weights(data_dir, uninterrupted, tmp_path):
    rng = random.Random(2026)
    cuts = sorted(rng.sample([s for s in range(1, EPOCHS * STEPS_PER_EPOCH) if s != BOUNDARY], 2))
    progress = run_in_sessions(data_dir, tmp_path / "w", cuts)
    assert progress["weights_sha256"] == uninterrupted["progress"]["weights_sha256"], f"cuts {cuts}"
    assert len(progress["sessions"]) == 3


def test_a_session_ending_exactly_at_the_stage_boundary_resumes_identically(data_dir, uninterrupted, tmp_path):
    progress = run_in_sessions(data_dir, tmp_path / "w", [BOUNDARY])
    assert progress["weights_sha256"] == uninterrupted["progress"]["weights_sha256"]
    assert [s["stage"] for s in progress["sessions"]] == ["ANSWER_FOCUS", "FORMAT_LEARNING"]
    records = report.dedupe_metrics(report.read_metrics(tmp_path / "w" / "metrics.jsonl"))
    assert report.stage_changes(records) == [(BOUNDARY, "FORMAT_LEARNING")]
    table = report.format_table(report.session_table(progress))
    assert "ANSWER_FOCUS" in table and "FORMAT_LEARNING" in table


FUSION = {"params": {"fusion_layers": 1, "fusion_heads": 4}}


def test_fusion_layers_have_the_formulas_parameters_and_resume_bit_identically(data_dir, tmp_path):
    """params.fusion_layers > 0: a Transformer encoder over the concatenated image + question states, whose
    size is fusion_parameters(d_model, d_ff, layers); split at a random step and at the stage boundary it ends
    with the weights of one uninterrupted run."""
    from relay.kernel.recipes.vqa_model import fusion_parameters

    spec = load(data_dir, **FUSION)
    recipe = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    model = recipe.build_model()
    p = recipe.params
    assert sum(t.numel() for t in model.fusion.parameters()) == fusion_parameters(p.d_model, p.d_ff, 1) == 33_600
    assert fusion_parameters(768, 3072, 2) == 14_177_280  # examples/vqa-t4.yaml: ~56.7 MB of fp32
    # the mask reaches the fusion encoder: padded question positions do not change the unpadded outputs
    model.eval()
    batch = recipe.collate(list(VQARows(recipe, recipe.train_rows[:2])))
    ids, mask = batch["question_ids"], batch["question_mask"]
    wider = torch.cat([ids, ids.new_zeros(ids.shape[0], 3)], 1), torch.cat([mask, mask.new_zeros(mask.shape[0], 3)], 1)
    with torch.no_grad():
        a = model.encode(batch["pixel_values"], ids, mask)[0].last_hidden_state
        b = model.encode(batch["pixel_values"], *wider)[0].last_hidden_state[:, : a.shape[1]]
    assert torch.allclose(a, b, atol=1e-5)

    reference = run_session(load(data_dir, **FUSION), tmp_path / "ref")
    assert reference["status"] == "done"
    cut = random.Random(7).choice([s for s in range(1, BOUNDARY)])
    progress = run_in_sessions(data_dir, tmp_path / "w", [cut, BOUNDARY], **FUSION)
    assert progress["weights_sha256"] == reference["weights_sha256"], f"cut {cut}"


def test_stage_is_a_pure_function_of_the_epoch(data_dir):
    spec = load(data_dir)
    recipe = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    names = [recipe.on_step(step, step // STEPS_PER_EPOCH)["stage"] for step in (10, 0, 7, 8, 15, 1)]
    assert names == ["FORMAT_LEARNING", "ANSWER_FOCUS", "ANSWER_FOCUS", "FORMAT_LEARNING", "FORMAT_LEARNING",
                     "ANSWER_FOCUS"]


# -- the OOM ladder -------------------------------------------------------------------------------------
class Limits:
    """The simulated device: what fits. An OOM is raised while a setting is above its limit."""

    def reset(self) -> None:
        self.micro_batch, self.answer_cap, self.beams, self.eval_chunk = 1, 8, 1, 4
        self.ooms: list[str] = []  # what ran out, in order
        self.recipe = None


LIMITS = Limits()


class TightMemoryVQA(VQAStudentRecipe):
    name = "tight-memory-vqa"

    def loss(self, model, batch):
        LIMITS.recipe = self
        n = len(batch["row"])
        if n > LIMITS.micro_batch or self.answer_cap > LIMITS.answer_cap:
            LIMITS.ooms.append(f"train n={n} answer_cap={self.answer_cap}")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().loss(model, batch)

    def generate(self, model, batch):
        chunk = len(batch["row"])
        if self.beams > LIMITS.beams or chunk > LIMITS.eval_chunk:
            LIMITS.ooms.append(f"eval beams={self.beams} chunk={chunk}")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().generate(model, batch)


@pytest.fixture
def tight(register_recipe):
    register_recipe(TightMemoryVQA.name, TightMemoryVQA)
    LIMITS.reset()
    yield LIMITS
    LIMITS.reset()


def test_oom_ladder_walks_the_seeds_order_and_holds_across_sessions(data_dir, tmp_path, tight):
    workdir = tmp_path / "w"
    first = run_session(load(data_dir, recipe=TightMemoryVQA.name, **{"session.max_steps": STEPS_PER_EPOCH + 1}),
                        workdir)
    # All in the pre-flight, before step 0: micro-batch 4 -> 2 -> 1, answer length 12 -> 8, then its eval
    # batch at eval_batch x num_beams: 2 -> 1 beams, then chunks of 4.
    assert tight.ooms == ["train n=4 answer_cap=12", "train n=2 answer_cap=12", "train n=1 answer_cap=12",
                          "eval beams=2 chunk=12", "eval beams=1 chunk=12"]
    memory = [r for r in report.read_metrics(workdir / "metrics.jsonl") if r["kind"] == "memory"]
    assert [(r["rung"], r["phase"], r["step"]) for r in memory] == [
        ("micro_batch", "train", 0), ("micro_batch", "train", 0), ("answer_len", "train", 0),
        ("num_beams", "eval", 0), ("eval_batch", "eval", 0)]
    assert (first["micro_batch"], first["grad_accum"]) == (1, 8)  # effective batch 8 kept
    assert first["memory_rungs"] == ["answer_len", "num_beams", "eval_batch"]
    assert first["global_step"] == STEPS_PER_EPOCH + 1 and first["metrics"]["step"] == STEPS_PER_EPOCH  # past an eval
    row = report.session_table(first)[0]
    assert row["memory_rungs"] == "micro_batch, micro_batch, answer_len, num_beams, eval_batch"
    assert "answer_len" in report.format_table([row])

    tight.ooms.clear()
    second = run_session(load(data_dir, recipe=TightMemoryVQA.name), workdir)
    assert second["status"] == "done" and tight.ooms == []  # nothing that failed is tried again
    recipe = tight.recipe
    assert (recipe.answer_cap, recipe.beams, recipe.eval_chunk) == (8, 1, 4)
    assert (second["micro_batch"], second["grad_accum"]) == (1, 8)
    assert second["memory_rungs"] == ["answer_len", "num_beams", "eval_batch"]
    assert "memory_rungs" not in second["sessions"][1]  # no new rung in session 2


def test_oom_with_the_ladder_exhausted_is_raised(data_dir, tmp_path, tight):
    tight.answer_cap = 4  # below even the rung's 8
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_session(load(data_dir, recipe=TightMemoryVQA.name), tmp_path / "w")
    assert tight.ooms[-1] == "train n=1 answer_cap=8"


def test_worst_case_batch_has_the_longest_questions_and_answers(data_dir):
    recipe = VQAStudentRecipe(load(data_dir).recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    recipe.on_step(0, 0)  # ANSWER_FOCUS: answers of 2 tokens
    items = [recipe.train_dataset()[i] for i in range(3)]
    for cap, length in ((12, 12), (8, 8)):  # FORMAT_LEARNING's 12, or the OOM rung's cap
        recipe.answer_cap = cap
        with recipe.worst_case(items) as worst:
            batch = recipe.collate(worst)
            assert recipe.stage.name == "FORMAT_LEARNING" and recipe._full_generate
        assert batch["question_ids"].shape == (3, 16) and batch["labels"].shape == (3, length)
        assert (batch["labels"] != -100).all() and (batch["labels"][:, -1] == recipe.a_tokenizer.eos_token_id).all()
        assert (batch["question_ids"][:, 0] == recipe.q_tokenizer.cls_token_id).all()
        assert (batch["question_ids"][:, -1] == recipe.q_tokenizer.sep_token_id).all()
        assert recipe.stage.name == "ANSWER_FOCUS" and not recipe._full_generate  # restored


class SizedVQA(VQAStudentRecipe):
    name = "sized-vqa"
    last: list = []

    def loss(self, model, batch):
        SizedVQA.last.append(len(batch["row"]))
        return super().loss(model, batch)


def test_preflight_steps_the_optimizer_and_a_peak_over_90_percent_is_an_oom(data_dir, tmp_path, monkeypatch,
                                                                            register_recipe):
    """The simulated device: micro-batches above 1 fit a forward/backward but not with AdamW's state."""
    from relay.kernel import trainer as loop
    from relay.kernel.session import memory

    register_recipe(SizedVQA.name, SizedVQA)
    optimizers, SizedVQA.last = [], []
    build = loop.build_optimizer
    monkeypatch.setattr(loop, "build_optimizer", lambda *a: optimizers.append(build(*a)) or optimizers[-1])
    monkeypatch.setattr(memory, "peak_fraction",
                        lambda device: 0.95 if optimizers[-1].state and SizedVQA.last[-1] > 1 else 0.5)
    progress = run_session(load(data_dir, recipe=SizedVQA.name, **{"session.max_steps": 1}), tmp_path / "w")
    assert SizedVQA.last[:3] == [4, 2, 1] and set(SizedVQA.last[3:]) == {1}  # backed off before step 0
    assert (progress["micro_batch"], progress["grad_accum"]) == (1, 8) and progress["global_step"] == 1
    memory_records = [r for r in report.read_metrics(tmp_path / "w" / "metrics.jsonl") if r["kind"] == "memory"]
    assert [(r["rung"], r["step"]) for r in memory_records] == [("micro_batch", 0), ("micro_batch", 0)]


def test_predict_uses_the_eval_batch_and_autocast_and_writes_atomically(data_dir, tmp_path, monkeypatch):
    import contextlib

    recipe = VQAStudentRecipe(load(data_dir).recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    torch.manual_seed(0)
    model = recipe.build_model()
    sizes, autocast_on, generate = [], [], recipe.generate

    @contextlib.contextmanager
    def autocast():
        autocast_on.append(True)
        yield
        autocast_on.pop()

    def spy(model, batch):
        sizes.append((len(batch["row"]), bool(autocast_on)))
        return generate(model, batch)

    monkeypatch.setattr(recipe, "generate", spy)
    path = recipe.predict(model, tmp_path, batch_size=5, autocast=autocast)
    assert sizes == [(5, True)] * 3 + [(1, True)]  # 12 val + 4 test questions
    before = path.read_bytes()
    assert len(before.splitlines()) == 16 and [p.name for p in tmp_path.iterdir()] == ["predictions.jsonl"]
    recipe.eval_chunk, sizes[:] = 2, []  # the eval_batch rung applies too
    monkeypatch.setattr(recipe, "generate", lambda m, b: spy(m, b) if len(sizes) < 3 else 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a crash half-way leaves the previous file whole
        recipe.predict(model, tmp_path, batch_size=5, autocast=autocast)
    assert sizes == [(2, True)] * 3 and path.read_bytes() == before


def test_soft_targets_sit_at_each_words_first_token(data_dir, tmp_path):
    """"left," is two tokens: the teacher's logits for the words after it must move one token right."""
    data = _copy_data(data_dir, tmp_path)
    teacher = data / "teacher_outputs.jsonl"
    rows = [json.loads(line) for line in teacher.read_text().splitlines()]
    rows[0] = {"id": rows[0]["id"], "answer": "left, red circle",
               "logits": [{"left": 3.0}, {"red": 3.5, "blue": 1.0}, {"circle": 3.2}]}
    teacher.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = VQAStudentRecipe(load(data).recipe_params(), data_dir=data, cache_dirs=[], seed=0)
    recipe.prepare()
    tok = recipe.a_tokenizer
    left, comma, red, blue, circle = (tok.convert_tokens_to_ids(t) for t in ("left", ",", "red", "blue", "circle"))
    assert recipe.answer_ids[0].tolist() == [left, comma, red, circle, tok.eos_token_id]
    ids, values = recipe.soft[0]
    assert ids.shape == (5, recipe.params.soft_top_k)
    assert ids[0, 0] == left and ids[2, :2].tolist() == [red, blue] and ids[3, 0] == circle
    assert (values[[1, 4]] == NO_LOGIT).all()  # the comma and EOS carry no teacher target
    assert first_tokens("left, red circle", tok) == [0, 2, 3]


def test_config_built_decoder_has_no_t5_encoder_and_generates_as_with_one(data_dir):
    """T5's own encoder never runs (encoder_outputs come from the vision and question encoders): config-built
    decoders have none. Generation equals a T5 with an encoder and the same decoder weights, beams and cache on."""
    from transformers import T5ForConditionalGeneration

    recipe = VQAStudentRecipe(load(data_dir).recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    torch.manual_seed(0)
    model = recipe.build_model().eval()
    assert len(model.decoder.encoder.block) == 0 and model.decoder.config.num_decoder_layers == 2
    with_encoder = T5ForConditionalGeneration(model.decoder.config.__class__(
        **{**model.decoder.config.to_dict(), "num_layers": 2})).eval()
    assert with_encoder.load_state_dict(model.decoder.state_dict(), strict=False).missing_keys == [
        k for k in with_encoder.state_dict() if k.startswith("encoder.block.")]
    batch = recipe.collate([recipe.eval_dataset()[i] for i in range(4)])
    lean = recipe.generate(model, batch)
    model.decoder = with_encoder
    assert recipe.generate(model, batch) == lean and recipe.beams == 2


# -- bad inputs -----------------------------------------------------------------------------------------
def _train(tmp_path: Path, capsys, spec: dict, data: Path) -> tuple[int, str]:
    spec = deep_merge(spec, {"params": {"data_dir": str(data)}})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = cli.main(["train", str(path), "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip()
    return code, err


def _copy_data(data_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "data"
    shutil.copytree(data_dir, target)
    return target


def _stages(*ranges):
    return [{"name": f"S{i}", "epochs": list(r), "answer_max_len": 4} for i, r in enumerate(ranges)]


@pytest.mark.parametrize("curriculum, expected", [
    (_stages((0, 2), (3, 4)), "spec.yaml: params.curriculum: stage 1 (S1) starts at epoch 3 but the stages before "
                              "end at 2: a gap; stages must be contiguous from epoch 0"),
    (_stages((0, 2), (1, 4)), "spec.yaml: params.curriculum: stage 1 (S1) starts at epoch 1 but the stages before "
                              "end at 2: an overlap; stages must be contiguous from epoch 0"),
    (_stages((0, 2), (2, 3)), "spec.yaml: params.curriculum: the stages end at epoch 3 but optim.epochs is 4: "
                              "they must cover the run exactly"),
    ([{**_stages((0, 4))[0], "answer_max_len": 13}], "spec.yaml: params.curriculum.0.answer_max_len: 13 is longer "
                                                     "than params.answer_max_len (12)"),
    ([{**_stages((0, 4))[0], "filter": "long_answer"}], "spec.yaml: params.curriculum.0.filter: Input should be "
                                                        "'all', 'short_answer' or 'has_logits' (got 'long_answer')"),
])
def test_bad_curriculum_is_a_one_line_error_naming_the_key(data_dir, tmp_path, capsys, curriculum, expected):
    code, err = _train(tmp_path, capsys, spec_dict(data_dir, **{"params.curriculum": curriculum}), data_dir)
    assert code == 2 and err == f"relay: error: {tmp_path / expected}"
    assert not (tmp_path / "work").exists()


def test_missing_teacher_outputs_name_the_file_and_the_first_question(data_dir, tmp_path, capsys):
    data = _copy_data(data_dir, tmp_path)
    teacher = data / "teacher_outputs.jsonl"
    lines = teacher.read_text().splitlines(keepends=True)
    teacher.write_text("".join(lines[:5] + lines[8:]))  # q00005..q00007 gone
    code, err = _train(tmp_path, capsys, spec_dict(data_dir), data)
    assert code == 2 and err == (f"relay: error: {teacher}: no teacher output for 3 train question(s), first id "
                                 f"'q00005' (questions.jsonl:6)")
    assert not (tmp_path / "work").exists()


def test_broken_image_names_the_image_and_the_question_line(data_dir, tmp_path, capsys):
    data = _copy_data(data_dir, tmp_path)
    (data / "images" / "img_00010.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    code, err = _train(tmp_path, capsys, spec_dict(data_dir), data)
    assert code == 2 and err.startswith(f"relay: error: {data / 'images' / 'img_00010.png'}: not a readable image")
    assert err.endswith(f"referenced at {data / 'questions.jsonl'}:11)") and "\n" not in err
    assert not (tmp_path / "work").exists()


def test_question_longer_than_the_model_maximum_names_the_line(data_dir, tmp_path, capsys):
    data = _copy_data(data_dir, tmp_path)
    questions = data / "questions.jsonl"
    rows = [json.loads(line) for line in questions.read_text().splitlines()]
    rows[3]["question"] = "what " * 20 + "?"
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = _train(tmp_path, capsys, spec_dict(data_dir), data)
    assert code == 2 and err == (f"relay: error: {questions}:4: question is 23 tokens, longer than "
                                 f"params.question_max_len (16)")
    assert not (tmp_path / "work").exists()


def test_bad_jsonl_line_names_the_line(data_dir, tmp_path, capsys):
    data = _copy_data(data_dir, tmp_path)
    teacher = data / "teacher_outputs.jsonl"
    lines = teacher.read_text().splitlines(keepends=True)
    lines[2] = '{"id": "q00002", "answer": \n'
    teacher.write_text("".join(lines))
    code, err = _train(tmp_path, capsys, spec_dict(data_dir), data)
    assert code == 2 and err.startswith(f"relay: error: {teacher}:3: not valid JSON")
    assert not (tmp_path / "work").exists()


def test_generated_data_is_deterministic_and_answers_depend_on_the_image(tmp_path):
    vqa_data.generate(tmp_path / "a", 20, 4, 2, 16, seed=3, noise=0.0, logits_fraction=1.0)
    vqa_data.generate(tmp_path / "b", 20, 4, 2, 16, seed=3, noise=0.0, logits_fraction=1.0)
    for name in ("questions.jsonl", "teacher_outputs.jsonl", "images/img_00007.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    from PIL import Image

    samples = vqa_data.load(tmp_path / "a", "images", "questions.jsonl", "teacher_outputs.jsonl")
    color_questions = [s for s in samples if s.question == "what color is the shape ?"]
    assert color_questions
    for s in color_questions:
        pixels = {tuple(p) for p in __import__("numpy").asarray(Image.open(s.image)).reshape(-1, 3).tolist()}
        answer = s.teacher or s.answer
        assert vqa_data.COLORS[answer] in pixels  # the answer is the colour drawn
        assert vqa_data.pixel_values(s.image, 16).shape == (3, 16, 16)


def test_pretrained_folders_are_loaded_with_their_tokenizers(data_dir, uninterrupted, tmp_path):
    """The real-data path: params.*_pretrained name mounted save_pretrained folders (here: the parts of a
    trained tiny student) and replace the random-init models and the trained tokenizer."""
    spec = load(data_dir)
    recipe = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    torch.manual_seed(5)
    source = recipe.build_model()
    for part in ("vision", "question", "decoder"):
        getattr(source, part).save_pretrained(tmp_path / part)
    recipe.q_tokenizer.save_pretrained(tmp_path / "question")
    recipe.a_tokenizer.save_pretrained(tmp_path / "decoder")
    params = {"vision_pretrained": str(tmp_path / "vision"), "question_pretrained": str(tmp_path / "question"),
              "decoder_pretrained": str(tmp_path / "decoder")}
    spec = load(data_dir, params=params)
    loaded = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    loaded.prepare()
    assert loaded.q_tokenizer.get_vocab() == recipe.q_tokenizer.get_vocab()
    torch.manual_seed(6)  # a different init: only the projections may differ
    model = loaded.build_model()
    for part in ("vision", "question", "decoder"):
        for name, tensor in getattr(source, part).state_dict().items():
            assert torch.equal(tensor, getattr(model, part).state_dict()[name]), (part, name)
    missing = load(data_dir, params={"vision_pretrained": str(tmp_path / "nowhere")})
    with pytest.raises(InputError, match=r"params.vision_pretrained: .*nowhere is not a folder"):
        VQAStudentRecipe(missing.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0).prepare()


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def test_pretrained_vision_folder_brings_its_normalization_and_sizes_are_checked(data_dir, tmp_path):
    """params.vision_pretrained: images are normalized with the folder's preprocessor_config.json (BLIP's are
    CLIP's mean/std); image_size / patch_size that disagree with the folder are one-line errors in prepare()."""
    spec = load(data_dir)
    recipe = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    folder = tmp_path / "vision"
    recipe.build_model().vision.save_pretrained(folder)  # ViT, 32 px, patch 8
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "BlipImageProcessor", "do_normalize": True, "do_rescale": True,
         "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "size": {"height": 32, "width": 32}}))

    def prepared(**params):
        rec = VQAStudentRecipe(load(data_dir, params={"vision_pretrained": str(folder), **params}).recipe_params(),
                               data_dir=data_dir, cache_dirs=[], seed=0)
        rec.prepare()
        return rec

    loaded = prepared()
    assert loaded.image_mean == tuple(CLIP_MEAN) and loaded.image_std == tuple(CLIP_STD)
    row = loaded.train_rows[0]
    got = VQARows(loaded, [row])[0]["pixel_values"]
    plain = vqa_data.pixel_values(loaded.samples[row].image, 32)  # [-1, 1]: 0.5 / 0.5
    unit = plain * 0.5 + 0.5
    expected = (unit - torch.tensor(CLIP_MEAN)[:, None, None].numpy()) / torch.tensor(CLIP_STD)[:, None, None].numpy()
    assert got.shape == (3, 32, 32) and abs(got - expected).max() < 1e-5

    with pytest.raises(InputError) as err:
        prepared(image_size=64)
    assert str(err.value) == (f"params.image_size: 64, but the pretrained vision model {folder / 'config.json'} "
                              f"has image_size 32")
    with pytest.raises(InputError, match=r"^params.patch_size: 4, but .*config.json has patch_size 8$"):
        prepared(patch_size=4)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                                                                 "size": {"height": 48, "width": 48}}))
    with pytest.raises(InputError, match=r"^params.image_size: 32, but .*preprocessor_config.json has size 48$"):
        prepared()
    (folder / "preprocessor_config.json").unlink()  # no processor: ViT's 0.5 / 0.5
    assert prepared().image_mean == vqa_data.IMAGE_MEAN
