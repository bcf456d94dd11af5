"""Multi-timeframe series (seed 003): the bar-file reader, the windowed features, and synthetic bars.

A bar file is a CSV with columns `timestamp, close, volume` (one row per bar, in time order; extra columns are
ignored). Features are computed over several timeframes (returns over 1/5/15/60 bars, realised volatility,
a volume z-score, distance to a moving average), the target is the forward log return over `horizon` bars
(in percent). `relay data temporal --out DIR` writes bars.csv whose returns carry momentum and a daily cycle,
so a model that sees a window of features can beat predicting zero.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from relay.shared.errors import InputError
from relay.shared.inputs import OneLineArgumentParser, check_field_counts

COLUMNS = ("timestamp", "close", "volume")
TIMEFRAMES = (1, 5, 15, 60)


def read_bars(path: Path) -> pd.DataFrame:
    """close and volume as float64, checked row by row; raises InputError naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found (expected a CSV with columns {', '.join(COLUMNS)})")
    try:
        frame = pd.read_csv(path, usecols=lambda c: c in COLUMNS, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: empty file (expected a header {','.join(COLUMNS)} and rows)") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    check_field_counts(path)
    for column in ("close", "volume"):
        text = frame[column].str.strip()
        values = pd.to_numeric(text, errors="coerce")
        empty = (text == "") | text.str.lower().isin(["nan", "na", "null"])
        if empty.any():
            row = int(empty.to_numpy().argmax())
            raise InputError(f"{path}: line {row + 2}: {column} is missing (NaN); every bar needs one")
        if values.isna().any():
            row = int(values.isna().to_numpy().argmax())
            raise InputError(f"{path}: line {row + 2}: {column} must be a number (got {frame[column].iloc[row]!r})")
        infinite = ~np.isfinite(values.to_numpy())  # "inf" parses as a number; its log return is not one
        if infinite.any():
            row = int(infinite.argmax())
            raise InputError(f"{path}: line {row + 2}: {column} must be finite (got {frame[column].iloc[row]!r})")
        if column == "close" and (values <= 0).any():
            row = int((values <= 0).to_numpy().argmax())
            raise InputError(f"{path}: line {row + 2}: close must be > 0 (got {frame[column].iloc[row]!r})")
        frame[column] = values.astype(np.float64)
    return frame[list(COLUMNS)]


def lookback() -> int:
    """Bars of history a feature row needs."""
    return max(TIMEFRAMES)


def features(bars: pd.DataFrame, horizon: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Feature rows (float32, NaN where history is short) and the forward return target (NaN at the end)."""
    log_close = np.log(bars["close"].to_numpy())
    s = pd.Series(log_close)
    r1 = s.diff()
    out = {}
    for tf in TIMEFRAMES:
        out[f"ret_{tf}"] = 100 * s.diff(tf)
        if tf > 1:
            out[f"vol_{tf}"] = 100 * r1.rolling(tf).std()
            out[f"ma_gap_{tf}"] = 100 * (s - s.rolling(tf).mean())
    volume = np.log1p(bars["volume"])
    out["volume_z"] = (volume - volume.rolling(60).mean()) / (volume.rolling(60).std() + 1e-6)
    target = 100 * (s.shift(-horizon) - s)
    return pd.DataFrame(out).astype(np.float32), target.to_numpy(np.float32)


# --------------------------------------------------------------------------------------------- synthetic
def make_bars(n: int, seed: int) -> pd.DataFrame:
    """Bars whose 1-bar returns follow AR(1) momentum plus a cycle of 390 bars (a trading day), with
    volume that rises with absolute returns."""
    if n < lookback() + 10:
        raise ValueError(f"temporal data: need at least {lookback() + 10} bars, got {n}")
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    drift = 0.0004 * np.sin(2 * np.pi * t / 390)
    noise = rng.normal(0.0, 0.001, n)
    returns = np.empty(n)
    prev = 0.0
    for i in range(n):
        prev = 0.45 * prev + drift[i] + noise[i]
        returns[i] = prev
    close = 100 * np.exp(np.cumsum(returns))
    volume = np.round(1000 * np.exp(rng.normal(0, 0.3, n)) * (1 + 300 * np.abs(returns))).astype(np.int64)
    timestamp = pd.Timestamp("2024-01-02 09:30") + pd.to_timedelta(t, unit="min")
    return pd.DataFrame({"timestamp": timestamp.strftime("%Y-%m-%d %H:%M"), "close": np.round(close, 4),
                         "volume": volume})


def generate(out_dir: str | Path, n: int, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bars.csv"
    make_bars(n, seed).to_csv(path, index=False)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="relay data temporal", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for bars.csv")
    parser.add_argument("--rows", type=int, default=20000, help="bars (one per minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = generate(args.out, args.rows, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {path} ({args.rows} bars)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
