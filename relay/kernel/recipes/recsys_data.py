"""Ratings shaped like MovieLens (seed 000): the compact reader into a float32 CSR matrix, and synthetic ratings.

The read path is the seed's: only `userId, movieId, rating` (`usecols`), as int32/int32/float32, straight into
CSR (row pointers, int32 column indices, float32 values) without a dense user x item frame. Bad files are
one-line InputErrors naming the file and the line; the slow line-finding parse runs only after the fast one
failed. `relay data recsys --out DIR` writes ratings.csv from a low-rank model (user and item factors plus
biases and noise, rounded to half stars), so RMSE and precision@10 of the recipe's models mean something.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser, check_field_counts

COLUMNS = ("userId", "movieId", "rating")
DTYPES = {"userId": np.int32, "movieId": np.int32, "rating": np.float32}


@dataclass
class CSR:
    """A float32 CSR matrix in three numpy arrays (scipy is not needed for what the recipe does with it)."""

    indptr: np.ndarray  # int64, n_rows + 1
    indices: np.ndarray  # int32 column of each value, sorted within a row
    data: np.ndarray  # float32
    shape: tuple[int, int]

    @classmethod
    def from_coo(cls, rows: np.ndarray, cols: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> "CSR":
        order = np.lexsort((cols, rows))
        indptr = np.zeros(shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=shape[0]), out=indptr[1:])
        return cls(indptr, cols[order].astype(np.int32), values[order].astype(np.float32), shape)

    @property
    def nnz(self) -> int:
        return len(self.data)

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.indices.nbytes + self.data.nbytes

    def row_ids(self) -> np.ndarray:
        """The row of every stored value (int64), i.e. the COO rows; computed once."""
        if "_rows" not in self.__dict__:
            self.__dict__["_rows"] = np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))
        return self.__dict__["_rows"]

    def transpose(self) -> "CSR":
        return CSR.from_coo(self.indices.astype(np.int64), self.row_ids(), self.data, (self.shape[1], self.shape[0]))

    def keys(self) -> np.ndarray:
        """row * n_cols + col of every value, ascending: `searchsorted` finds any (row, col) in O(log nnz)."""
        return self.row_ids() * self.shape[1] + self.indices


def read_ratings(path: Path) -> pd.DataFrame:
    """userId/movieId int32 and rating float32 columns only; InputError naming the file and line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found (expected a CSV with columns {', '.join(COLUMNS)}[, timestamp])")
    try:
        header = pd.read_csv(path, nrows=0).columns
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: empty file (expected a header {','.join(COLUMNS)} and rows)") from None
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    check_field_counts(path)
    try:
        frame = pd.read_csv(path, usecols=list(COLUMNS), dtype=DTYPES)
    except (ValueError, OverflowError):
        _raise_bad_line(path)
        raise
    nan = frame["rating"].isna().to_numpy()
    if nan.any():
        raise InputError(f"{path}: line {int(nan.argmax()) + 2}: rating is missing (NaN); every row needs one")
    infinite = ~np.isfinite(frame["rating"].to_numpy())  # "inf" parses as a float and would reach the SVD
    if infinite.any():
        row = int(infinite.argmax())
        raise InputError(f"{path}: line {row + 2}: rating must be finite (got {frame['rating'].iloc[row]})")
    if frame.empty:
        raise InputError(f"{path}: no ratings (expected at least one row)")
    return frame


def _raise_bad_line(path: Path) -> None:
    """The fast typed read failed: find the first row that does not parse, as text, and name it."""
    frame = pd.read_csv(path, usecols=list(COLUMNS), dtype=str, keep_default_na=False)
    for column in COLUMNS:
        text = frame[column].str.strip()
        numbers = pd.to_numeric(text, errors="coerce")
        if column == "rating":
            bad = numbers.isna() & (text != "") & ~text.str.lower().isin(["nan", "na"])
            blank = (text == "") | text.str.lower().isin(["nan", "na"])
            if blank.any() and not bad[: int(blank.to_numpy().argmax())].any():
                raise InputError(f"{path}: line {int(blank.to_numpy().argmax()) + 2}: rating is missing (NaN); "
                                 "every row needs one")
        else:
            bad = numbers.isna() | (numbers != numbers.round()) | (numbers.abs() > np.iinfo(np.int32).max)
        if bad.any():
            row = int(bad.to_numpy().argmax())
            kind = "a number" if column == "rating" else "an integer id"
            raise InputError(f"{path}: line {row + 2}: {column} must be {kind} (got {frame[column].iloc[row]!r})")


def synthetic_ratings(n_ratings: int, n_users: int, n_items: int, rank: int, seed: int) -> pd.DataFrame:
    """Distinct (user, item) pairs with popular items rated more often; rating = clip(3.5 + biases + <u, v> + noise)
    rounded to half stars."""
    if n_ratings > n_users * n_items // 2:
        raise ValueError(f"recsys data: {n_ratings} ratings need more than {n_users} users x {n_items} items / 2")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, n_items + 1) ** 0.8
    popularity /= popularity.sum()
    keys = np.empty(0, dtype=np.int64)
    while len(keys) < n_ratings:
        draw = 2 * (n_ratings - len(keys)) + 1000
        users, items = rng.integers(0, n_users, draw), rng.choice(n_items, draw, p=popularity)
        keys = np.unique(np.concatenate([keys, users.astype(np.int64) * n_items + items]))
    keys = rng.permutation(keys)[:n_ratings]
    users, items = keys // n_items, keys % n_items
    u, v = rng.normal(0, 0.6 / rank ** 0.25, (n_users, rank)), rng.normal(0, 0.6 / rank ** 0.25, (n_items, rank))
    user_bias, item_bias = rng.normal(0, 0.3, n_users), rng.normal(0, 0.4, n_items)
    score = 3.5 + user_bias[users] + item_bias[items] + np.einsum("ij,ij->i", u[users], v[items])
    rating = np.clip(np.round((score + rng.normal(0, 0.3, n_ratings)) * 2) / 2, 0.5, 5.0)
    order = np.lexsort((items, users))
    return pd.DataFrame({"userId": users[order] + 1, "movieId": items[order] + 1, "rating": rating[order],
                         "timestamp": 1_500_000_000 + rng.integers(0, 10**8, n_ratings)})


def generate(out_dir: str | Path, n_ratings: int, n_users: int, n_items: int, rank: int = 8, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ratings.csv"
    synthetic_ratings(n_ratings, n_users, n_items, rank, seed).to_csv(path, index=False)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="relay data recsys", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ratings.csv")
    parser.add_argument("--ratings", type=int, default=50_000, help="ratings (the seed's safe size: 50k)")
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rank", type=int, default=8, help="rank of the hidden user/item factors")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = generate(args.out, args.ratings, args.users, args.items, args.rank, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {path} ({args.ratings} ratings, {args.users} users, {args.items} items)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
