"""Legal sentence classification data (seed 001): synthetic legal-like sentences and the real-file reader.

Real files are CSV (columns `text,label`) or JSON Lines (`{"text": ..., "label": ...}` per line). Every bad
row is a one-line InputError naming the file and its line (CSV line numbers count the header as line 1).

`relay data legal --out DIR` writes train.csv and val.csv whose label (a rhetorical role of the sentence in
a judgment, as in InLegalBERT's tasks) depends on the sentence's content: each role has its own cue
phrases, mixed with filler shared by all roles and a little label noise, so macro-F1 rises with training.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pandas as pd

from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser

COLUMNS = ("text", "label")

ROLES = {
    "facts": ["the appellant was employed as", "on the night of the incident", "the complainant lodged an fir",
              "the property was purchased in", "the accused was arrested at", "the deceased was found near"],
    "argument": ["learned counsel for the appellant submitted", "it was vehemently contended that",
                 "the respondent argued that", "counsel urged that the finding", "it is the case of the petitioner"],
    "statute": ["under section 302 of the indian penal code", "article 21 of the constitution guarantees",
                "section 138 of the negotiable instruments act", "order vii rule 11 of the code of civil procedure",
                "the provisions of section 34 ipc"],
    "precedent": ["this court in its earlier decision held", "as laid down in the celebrated case of",
                  "relying on the ratio of the full bench", "the supreme court has consistently held",
                  "following the judgment reported in"],
    "ruling": ["the appeal is accordingly dismissed", "the conviction is set aside and", "we allow the petition",
               "the impugned order is quashed", "the matter is remanded to the trial court"],
}
FILLER = ["in the present case", "having regard to the evidence", "it is pertinent to note", "in these circumstances",
          "the high court", "the trial court", "the material on record", "with costs", "the learned judge",
          "at the relevant time", "in our considered view", "the said document"]
PARTIES = ["state of maharashtra", "union of india", "ram prasad", "m/s sharma traders", "the municipal corporation",
           "smt. kamla devi", "the insurance company", "the bank"]
LABEL_NOISE = 0.05


def make_frame(n: int, seed: int) -> pd.DataFrame:
    """n sentences: a role's cue phrase, 2-5 filler phrases and a party, in a seeded order."""
    if n < 1:
        raise ValueError(f"legal data: need at least 1 row, got {n}")
    rng = np.random.default_rng(seed)
    roles = sorted(ROLES)
    texts, labels = [], []
    for _ in range(n):
        role = roles[rng.integers(len(roles))]
        parts = [ROLES[role][rng.integers(len(ROLES[role]))], PARTIES[rng.integers(len(PARTIES))]]
        parts += [FILLER[i] for i in rng.choice(len(FILLER), size=rng.integers(2, 6), replace=False)]
        order = rng.permutation(len(parts))
        texts.append(", ".join(parts[i] for i in order).capitalize() + ".")
        labels.append(roles[rng.integers(len(roles))] if rng.random() < LABEL_NOISE else role)
    return pd.DataFrame({"text": texts, "label": labels})


def generate(out_dir: str | Path, n_train: int, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """Write out_dir/train.csv and out_dir/val.csv; the same arguments give byte-identical files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = make_frame(n_train + n_val, seed)
    train_path, val_path = out_dir / "train.csv", out_dir / "val.csv"
    frame.iloc[:n_train].to_csv(train_path, index=False)
    frame.iloc[n_train:].to_csv(val_path, index=False)
    return train_path, val_path


# ------------------------------------------------------------------------------------------------ reading
def read_labelled(path: Path) -> pd.DataFrame:
    """`text`, `label` (both str) of a CSV or JSONL file; raises InputError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found (expected a CSV or JSONL file with fields text, label)")
    frame = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_csv(path)
    if frame.empty:
        raise InputError(f"{path}: no rows (expected at least one text with a label)")
    for column in COLUMNS:
        blank = frame[column].str.strip() == ""
        if blank.any():
            raise InputError(f"{path}: line {line_of(frame, int(blank.to_numpy().argmax()))}: empty {column}")
    return frame


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path, usecols=lambda c: c in COLUMNS, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a readable CSV ({str(exc).splitlines()[0]})") from None
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: empty file (expected a header text,label and rows)") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    frame = frame[list(COLUMNS)]
    frame.attrs["csv_path"] = str(path)  # line_of counts physical lines from it, only when an error needs one
    return frame


def _read_jsonl(path: Path) -> pd.DataFrame:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}: line {number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}: line {number}: expected an object with text and label")
            for column in COLUMNS:
                if column not in record:
                    raise InputError(f"{path}: line {number}: missing field {column}")
            if not isinstance(record["text"], str):
                raise InputError(f"{path}: line {number}: text must be a string (got {type(record['text']).__name__})")
            if not isinstance(record["label"], (str, int)) or isinstance(record["label"], bool):
                raise InputError(f"{path}: line {number}: label must be a string or an integer "
                                 f"(got {type(record['label']).__name__})")
            rows.append((record["text"], str(record["label"]), number))
    frame = pd.DataFrame(rows, columns=[*COLUMNS, "_line"])
    frame.attrs["lines"] = frame.pop("_line").tolist()
    return frame


def line_of(frame: pd.DataFrame, row: int) -> int:
    """The file line a row starts on: JSONL rows keep their own numbers; a CSV's are counted on demand (a
    quoted text may span several lines, and pandas skips blank lines), else row + 2 after the header."""
    lines = frame.attrs.get("lines")
    if lines is None and frame.attrs.get("csv_path"):
        lines = frame.attrs["lines"] = _csv_record_lines(Path(frame.attrs["csv_path"]))
    return lines[row] if lines and row < len(lines) else row + 2


def _csv_record_lines(path: Path) -> list[int]:
    """The first physical line of each data record of a CSV (the header's record excluded, blank lines skipped
    as pandas does), with the csv module's quoting: a quoted field's newlines do not end its record."""
    starts, previous = [], 0
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for record in reader:
            if record:
                starts.append(previous + 1)
            previous = reader.line_num
    return starts[1:]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="relay data legal", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for train.csv and val.csv")
    parser.add_argument("--train", type=int, default=4000, help="training sentences")
    parser.add_argument("--val", type=int, default=800, help="validation sentences")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        train_path, val_path = generate(args.out, args.train, args.val, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {train_path} ({args.train} rows) and {val_path} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
