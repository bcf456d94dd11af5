"""`make demo`: a whole relay on a local Kaggle emulator, on CPU, through the same code as production.

1. generate synthetic price data and publish it to the emulator as a dataset (as a user uploads theirs);
2. run the `relay` Prefect flow (ephemeral Prefect: no server) on examples/price-demo.yaml, whose
   sessions of 40 optimizer steps (`session.max_steps`) make a relay of 5 Kaggle sessions on any machine that hand checkpoints over as dataset versions;
3. meanwhile train the same spec uninterrupted in one process, and compare the final weights.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "price-demo.yaml"
RUN = ROOT / "runs" / "demo"
USER = "demo"


def main() -> int:
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    key = secrets.token_hex(16)
    # The kaggle client keeps upload state in $TMPDIR and reads ~/.kaggle: keep both inside the run.
    for name in ("home", "tmp"):
        (RUN / name).mkdir()
    os.environ.update(HOME=str(RUN / "home"), TMPDIR=str(RUN / "tmp"), KAGGLE_USERNAME=USER, KAGGLE_KEY=key,
                      HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    from relay.kernel.recipes import price_data

    data = RUN / "data"
    price_data.generate(data, 1200, 200, 0)

    # The uninterrupted reference run trains on the other core while the relay runs.
    reference = subprocess.Popen(
        [sys.executable, "-m", "relay", "train", str(SPEC), "--workdir", str(RUN / "reference"),
         "--budget", "none", "--max-steps", "none", "--data", str(data)],
        stdout=subprocess.DEVNULL, stderr=open(RUN / "reference.log", "w"))

    from relay.emulator import Emulator, EmulatorConfig

    emulator = Emulator(RUN / "emulator", EmulatorConfig(
        users={USER: key}, kernel_env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})).start()
    os.environ["RELAY_KAGGLE_ENDPOINT"] = emulator.url
    print(f"emulator: {emulator.url} (state {RUN / 'emulator'})")
    try:
        from relay.orchestrator.kaggle import from_env

        backend = from_env(dataset_poll_s=0.2)
        result = backend.publish_folder(data, f"{USER}/price-data", "Synthetic price data")
        print(f"published {USER}/price-data v{result.version}: {', '.join(sorted(result.files))}")

        if not os.environ.get("PREFECT_API_URL"):  # the relay's own Prefect, set up as `relay run` sets it up
            from relay.orchestrator import embedded_prefect

            embedded_prefect.configure(RUN / "orchestrator")
        from flows.one_relay import relay

        t0 = time.time()
        summary = relay(spec=str(SPEC), mode="watch", poll_seconds=1.0, state_dir=str(RUN / "orchestrator"))
        print(f"relay {summary['state']} in {time.time() - t0:.0f} s")
    finally:
        emulator.stop()
    reference.wait()
    return report(summary)


def report(summary: dict) -> int:
    from relay.orchestrator import goodput
    from relay.orchestrator import report as rep
    from relay.shared import runtime

    local = RUN / "orchestrator" / "price-demo"
    progress = json.loads((local / "published" / "progress.json").read_text())
    print()
    print(rep.format_table(rep.session_table(progress)))
    for note in runtime.change_notes(progress["sessions"]):  # another CPU, GPU, torch, image ...
        print(f"warning: {note}")
    print()
    print(goodput.from_progress(progress).line())  # where the (emulated) GPU time went, docs/relay.md
    smape = progress["metrics"].get("smape")
    print(f"final SMAPE: {smape:.2f} %  (best {progress['best']['value']:.2f} % at step {progress['best']['step']})")
    print(f"loss curves: {local / 'curves.png'}")
    print(f"timeline:    {local / 'timeline.png'}")
    print(f"goodput:     {local / 'goodput.png'}")
    print(f"final model: dataset {USER}/price-demo-model (emulator state {RUN / 'emulator'});"
          f" kernel output {local / 'outputs'}")
    ok, verdict = runtime.exact_resume(progress, json.loads((RUN / "reference" / "progress.json").read_text()))
    print(f"exact resume: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
