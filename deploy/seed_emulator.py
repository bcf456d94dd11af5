"""Publish the demo's data dataset into a running Kaggle emulator, as a user uploads theirs to Kaggle.

    python deploy/seed_emulator.py [--dataset demo/price-data] [--data runs/serve/data]

The emulator comes from RELAY_KAGGLE_ENDPOINT and the account from KAGGLE_USERNAME/KAGGLE_KEY (what
`python -m relay.emulator serve` prints). The data is the synthetic price data of `make demo`
(same sizes and seed, so byte-identical files); publishing is idempotent: a second run finds the same
version and publishes nothing. Used by deploy/serve.sh and tests/e2e/test_deployment.py.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = "demo/price-data"  # examples/price-demo.yaml mounts this (kaggle.dataset_sources)


def wait_for(endpoint: str, timeout: float) -> None:
    """Until the emulator accepts TCP connections (it starts in the background)."""
    url = urlparse(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((url.hostname, url.port or 80), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"seed_emulator: nothing listens on {endpoint} after {timeout:g} s")
            time.sleep(0.2)


def seed(backend, data_dir: Path, dataset: str = DEFAULT_DATASET, n_train: int = 1200, n_test: int = 200):
    """Generate the synthetic price data into `data_dir` and publish it as `dataset`; a PublishResult."""
    from relay.kernel.recipes import price_data

    price_data.generate(data_dir, n_train, n_test, 0)
    return backend.publish_folder(Path(data_dir), dataset, "Synthetic price data", "demo data")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=DEFAULT_DATASET, help="owner/slug (owner = the emulator's user)")
    parser.add_argument("--data", default=str(ROOT / "runs" / "serve" / "data"), help="where to write the CSVs")
    parser.add_argument("--train", type=int, default=1200)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the emulator to listen")
    args = parser.parse_args(argv)

    endpoint = os.environ.get("RELAY_KAGGLE_ENDPOINT")
    if not endpoint:
        print("seed_emulator: set RELAY_KAGGLE_ENDPOINT to the emulator's URL (this never publishes to Kaggle)",
              file=sys.stderr)
        return 2
    wait_for(endpoint, args.wait)
    sys.path.insert(0, str(ROOT))
    from relay.orchestrator.kaggle import from_env

    result = seed(from_env(dataset_poll_s=0.2), Path(args.data), args.dataset, args.train, args.test)
    state = "already there" if result.already_published else "published"
    print(f"{args.dataset} v{result.version} {state}: {', '.join(sorted(result.files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
