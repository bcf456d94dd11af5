"""VQA data (seed 002): the real layout's loader and a synthetic generator shaped like it.

Layout of a data folder (a Kaggle dataset mounted read-only):

    images/<file>              one image per question (PNG/JPEG; any size, resized when read)
    questions.jsonl            {"id", "image", "question", "split": "train"|"val"|"test", "answer"?}
    teacher_outputs.jsonl      {"id", "answer", "logits"?}: the teacher's answer to every train question;
                               "logits" (optional) is one {word: logit} map of top candidates per answer word

Every problem is one line naming the file (and line) and what is expected: `InputError`.
Images become `pixel_values` tensors here (PIL + numpy, no torchvision).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser

SPLITS = ("train", "val", "test")


@dataclass
class Sample:
    id: str
    image: Path
    question: str
    split: str
    line: int  # 1-based line in questions.jsonl, for error messages
    answer: Optional[str] = None  # ground truth (val/test), when the data has it
    teacher: Optional[str] = None  # the teacher's answer (train)
    teacher_logits: Optional[list] = None  # [{word: logit}, ...] per answer word
    extra: dict = field(default_factory=dict)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{number}: expected a JSON object")
            rows.append((number, row))
    return rows


def _text(path: Path, number: int, row: dict, key: str, required: bool = True) -> Optional[str]:
    value = row.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{path}:{number}: '{key}' must be a non-empty string (got {value!r})")
    return value.strip()


def _logits(path: Path, number: int, value) -> Optional[list]:
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(pos, dict) and pos and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in pos.items())
        for pos in value)
    if not ok:
        raise InputError(f"{path}:{number}: 'logits' must be a list of {{word: number}} maps, one per answer word")
    return value


def load(data_dir: Path, images_dir: str, questions_file: str, teacher_file: str) -> list[Sample]:
    """All samples, train ones joined with their teacher output. Images are checked to open (not decoded)."""
    data_dir = Path(data_dir)
    q_path, t_path, img_root = data_dir / questions_file, data_dir / teacher_file, data_dir / images_dir
    samples, seen = [], {}
    for number, row in read_jsonl(q_path):
        sid = row.get("id")
        if not isinstance(sid, (str, int)) or isinstance(sid, bool):
            raise InputError(f"{q_path}:{number}: 'id' must be a string or integer (got {sid!r})")
        sid = str(sid)
        if sid in seen:
            raise InputError(f"{q_path}:{number}: id {sid!r} repeats line {seen[sid]}")
        seen[sid] = number
        split = row.get("split", "train")
        if split not in SPLITS:
            raise InputError(f"{q_path}:{number}: 'split' must be one of {', '.join(SPLITS)} (got {split!r})")
        image = img_root / _text(q_path, number, row, "image")
        if not image.is_file():
            raise InputError(f"{q_path}:{number}: image {image} not found")
        samples.append(Sample(sid, image, _text(q_path, number, row, "question"), split, number,
                              answer=_text(q_path, number, row, "answer", required=False)))
    if not samples:
        raise InputError(f"{q_path}: no questions")
    teacher = {}
    for number, row in read_jsonl(t_path):
        sid = str(row.get("id"))
        if sid not in seen:
            raise InputError(f"{t_path}:{number}: id {sid!r} is not in {questions_file}")
        teacher[sid] = (_text(t_path, number, row, "answer"), _logits(t_path, number, row.get("logits")))
    for s in samples:
        if s.id in teacher:
            s.teacher, s.teacher_logits = teacher[s.id]
        elif s.split == "train":
            missing = sum(1 for x in samples if x.split == "train" and x.id not in teacher)
            raise InputError(f"{t_path}: no teacher output for {missing} train question(s), first id {s.id!r}"
                             f" ({q_path.name}:{s.line})")
    for s in samples:
        check_image(s.image, f"{q_path}:{s.line}")
    return samples


def check_image(path: Path, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise InputError(f"{path}: not a readable image ({type(err).__name__}; referenced at {where})") from None


IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)  # ViT's processors: [-1, 1]; a pretrained folder's own values replace it


def pixel_values(path: Path, size: int, mean: Sequence[float] = IMAGE_MEAN,
                 std: Sequence[float] = IMAGE_STD) -> np.ndarray:
    """RGB, resized to size x size, scaled to [0, 1] then normalized per channel, CHW float32."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.Resampling.BILINEAR)
        arr = np.asarray(im, dtype=np.float32) / 255.0
    out = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return out.transpose(2, 0, 1).astype(np.float32, copy=True)


def vision_preprocessing(folder: str, image_size: int, patch_size: int) -> tuple[tuple, tuple]:
    """(mean, std) of a pretrained vision folder's preprocessor_config.json (ViT's 0.5 without one; BLIP's are
    CLIP's), after checking params.image_size / patch_size against its config.json and preprocessor size."""
    from transformers import AutoConfig

    root = Path(folder)
    try:
        cfg = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"params.vision_pretrained: {folder}: no readable config.json ({first})") from None
    vision = getattr(cfg, "vision_config", None) or cfg  # a full BLIP checkpoint keeps them in vision_config
    for key, mine in (("image_size", image_size), ("patch_size", patch_size)):
        theirs = getattr(vision, key, None)
        if theirs is not None and theirs != mine:
            raise InputError(f"params.{key}: {mine}, but the pretrained vision model {root / 'config.json'} has "
                             f"{key} {theirs}")
    pre = root / "preprocessor_config.json"
    if not pre.is_file():
        return IMAGE_MEAN, IMAGE_STD
    try:
        conf = json.loads(pre.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{pre}: not valid JSON ({err})") from None
    size = conf.get("size")
    size = size.get("height", size.get("shortest_edge")) if isinstance(size, dict) else size
    if isinstance(size, int) and size != image_size:
        raise InputError(f"params.image_size: {image_size}, but {pre} has size {size}")
    if conf.get("do_normalize", True) is False:
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    stats = []
    for key, default in (("image_mean", IMAGE_MEAN), ("image_std", IMAGE_STD)):
        value = conf.get(key, default)
        value = [value] * 3 if isinstance(value, (int, float)) else value
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise InputError(f"{pre}: '{key}' must be 3 numbers (got {value!r})")
        stats.append(tuple(float(v) for v in value))
    if not all(v > 0 for v in stats[1]):
        raise InputError(f"{pre}: 'image_std' must be positive (got {list(stats[1])})")
    return stats[0], stats[1]


# ------------------------------------------------------------------------------------------ synthetic
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")
SIDES = ("left", "right")
QUESTIONS = {  # question -> answer built from (color, shape, side); the last one is a long, formatted answer
    "what color is the shape ?": lambda c, s, p: c,
    "which shape is in the picture ?": lambda c, s, p: s,
    "on which side is the shape ?": lambda c, s, p: p,
    "describe the picture .": lambda c, s, p: f"there is a {c} {s} on the {p} side",
}


def draw(rng: np.random.Generator, size: int, color: str, shape: str, side: str) -> np.ndarray:
    img = rng.integers(90, 150, size=(size, size, 3)).astype(np.uint8)  # noisy grey background
    r = max(2, size // 6)
    cy = size // 2 + int(rng.integers(-size // 8, size // 8 + 1))
    cx = (size // 4 if side == "left" else 3 * size // 4) + int(rng.integers(-size // 16, size // 16 + 1))
    yy, xx = np.mgrid[:size, :size]
    if shape == "square":
        mask = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
    elif shape == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    else:
        mask = (yy >= cy - r) & (yy <= cy + r) & (abs(xx - cx) <= (yy - (cy - r)) / 2)
    img[mask] = COLORS[color]
    return img


def generate(out: Path, n_train: int, n_val: int, n_test: int, image_size: int, seed: int, noise: float,
             logits_fraction: float) -> None:
    """Images with one coloured shape, questions whose answer depends on the image, and a noisy teacher."""
    from PIL import Image

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng, pyrng = np.random.default_rng(seed), random.Random(seed)
    vocab = [*COLORS, *SHAPES, *SIDES]
    questions, teacher = [], []
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    for i, split in enumerate(splits):
        color, shape, side = pyrng.choice(list(COLORS)), pyrng.choice(SHAPES), pyrng.choice(SIDES)
        name = f"img_{i:05d}.png"
        Image.fromarray(draw(rng, image_size, color, shape, side)).save(out / "images" / name)
        question = pyrng.choice(list(QUESTIONS))
        answer = QUESTIONS[question](color, shape, side)
        questions.append({"id": f"q{i:05d}", "image": name, "question": question, "split": split,
                          **({"answer": answer} if split != "train" else {})})
        if split != "train":
            continue
        words = answer.split()
        if pyrng.random() < noise:  # the teacher is wrong on one word
            j = pyrng.randrange(len(words))
            words[j] = pyrng.choice([w for w in vocab if w != words[j]])
        row = {"id": f"q{i:05d}", "answer": " ".join(words)}
        if pyrng.random() < logits_fraction:
            row["logits"] = [{w: round(3.0 + pyrng.random(), 3), **{d: round(pyrng.uniform(-1, 1), 3)
                              for d in pyrng.sample([v for v in vocab if v != w], 2)}} for w in words]
        teacher.append(row)
    (out / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (out / "teacher_outputs.jsonl").write_text("".join(json.dumps(t) + "\n" for t in teacher))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineArgumentParser(prog="relay data vqa", description="synthetic VQA data in the real layout")
    ap.add_argument("--out", required=True, help="folder to write images/, questions.jsonl, teacher_outputs.jsonl")
    ap.add_argument("--train", type=int, default=240)
    ap.add_argument("--val", type=int, default=48)
    ap.add_argument("--test", type=int, default=24)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="share of teacher answers with a wrong word")
    ap.add_argument("--logits-fraction", type=float, default=0.5, help="share of teacher outputs with soft targets")
    a = ap.parse_args(argv)
    generate(Path(a.out), a.train, a.val, a.test, a.image_size, a.seed, a.noise, a.logits_fraction)
    print(f"wrote {a.train + a.val + a.test} questions and {a.train} teacher outputs to {a.out}")
    return 0
