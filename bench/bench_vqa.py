"""Benchmark: the VQA student's training step with and without activation checkpointing on the T5 decoder.

CPU (always): the tiny model of examples/vqa-tiny.yaml (ViT 32 px + BERT + T5, d=64) on synthetic data, the
FORMAT_LEARNING stage (full-length answers), micro-batch `--micro` forward + backward + AdamW, one torch thread.
Two models with the same initial weights, one with checkpointing; rounds alternate which goes first and the
figures are medians of process CPU seconds (wall in brackets). The ratio is what matters: the seed expects
checkpointing to cost ~20 % more time.

CUDA (only when a GPU is present; not run on the CPU-only development machine): the real-size model of
examples/vqa-t4.yaml at micro-batch 3: fp32 vs AMP vs AMP + checkpointing, samples/s and peak memory, against
the seed's claims (AMP ~40 % less memory, checkpointing 30-40 % less at ~20 % more time).

CUDA, the pre-flight against the session (`run_preflight`, issue 48): `relay train examples/vqa-t4.yaml` on
`relay data vqa` data for 12 steps with an eval and a save, as the GPU itself and as a T4 (RELAY_EMULATE_GPU=t4:
15102 MiB cap, fp16 + GradScaler), the two sessions at once; per phase the peak allocated (reserved) MB from the
session record, the pre-flight's figure, and its ratio to the trained peak (1.0-1.1 is the goal).
Run: `python bench/bench_vqa.py [--steps N --repeats N]`; `run()` returns the named figures;
`python bench/bench_vqa.py --preflight [--out DIR]` only the pre-flight check (a few minutes on an H100).

CUDA, the back-off (`run_backoff`, issue 48 part 2): the same student as a T4 at micro-batch 24 x 1 without
activation checkpointing, more than 15 GB hold, through `relay verify-resume --steps 6 --cut-at 3` (one session
killed mid-save): the micro-batch each session backs off to, and whether the split run ends identical to the
straight one. `python bench/bench_vqa.py --backoff [--out DIR]`; on CPU (`--spec vqa-tiny.yaml --micro 8
--emulate none`) the same path runs with nothing to back off from.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _recipe(spec_file: str, data_dir: Path, **params):
    from relay.kernel.recipes.vqa_student import VQAStudentRecipe
    from relay.shared import spec as spec_mod

    raw = yaml.safe_load((REPO / "examples" / spec_file).read_text())
    raw["params"].update(data_dir=str(data_dir), **params)
    spec = spec_mod.validate(raw, source=spec_file)
    recipe = VQAStudentRecipe(spec.recipe_params(), data_dir=data_dir, cache_dirs=[], seed=0)
    recipe.prepare()
    recipe.on_step(0, spec.params["curriculum"][-1]["epochs"][0])  # the last stage: full-length answers
    return recipe


def _models(recipe, checkpointing: bool, device: str, vocab: tuple[int, int] | None = None):
    torch.manual_seed(0)
    model = recipe.build_model()
    if vocab:  # the synthetic data's tokenizers are tiny; give the embeddings and the LM head the real sizes
        model.question.resize_token_embeddings(vocab[0], mean_resizing=False)
        model.decoder.resize_token_embeddings(vocab[1], mean_resizing=False)
    if checkpointing:
        recipe.enable_activation_checkpointing(model)
    model.to(device).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _steps(recipe, model, opt, batches, device: str, amp: bool, scaler=None) -> None:
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            loss = recipe.loss(model, batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)


def run_cpu(steps: int = 20, repeats: int = 3, micro: int = 4) -> dict:
    from relay.kernel.recipes import vqa_data

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        vqa_data.generate(Path(tmp), 64, 8, 0, 32, seed=0, noise=0.1, logits_fraction=0.5)
        recipe = _recipe("vqa-tiny.yaml", Path(tmp))
        ds = recipe.train_dataset()
        batches = [recipe.collate([ds[(i * micro + j) % len(ds)] for j in range(micro)]) for i in range(steps)]
        pair = {False: _models(recipe, False, "cpu"), True: _models(recipe, True, "cpu")}
        for ckpt in (False, True):  # warm-up round
            _steps(recipe, *pair[ckpt], batches[:3], "cpu", False)
        cpu, wall = {False: [], True: []}, {False: [], True: []}
        for r in range(repeats):
            for ckpt in ((False, True) if r % 2 == 0 else (True, False)):
                c0, w0 = time.process_time(), time.perf_counter()
                _steps(recipe, *pair[ckpt], batches, "cpu", False)
                cpu[ckpt].append(time.process_time() - c0)
                wall[ckpt].append(time.perf_counter() - w0)
    samples = steps * micro
    plain, ckpt = statistics.median(cpu[False]), statistics.median(cpu[True])
    return {
        "vqa_cpu_steps": steps, "vqa_cpu_micro_batch": micro, "vqa_cpu_repeats": repeats,
        "vqa_cpu_samples_per_cpu_s": round(samples / plain, 2),
        "vqa_cpu_ckpt_samples_per_cpu_s": round(samples / ckpt, 2),
        "vqa_cpu_samples_per_s": round(samples / statistics.median(wall[False]), 2),
        "vqa_cpu_ckpt_samples_per_s": round(samples / statistics.median(wall[True]), 2),
        "vqa_cpu_ckpt_time_ratio": round(ckpt / plain, 3),  # > 1: checkpointing recomputes activations
    }


# The seed's vocabularies: PhoBERT's 64001 question tokens, VietT5's 36096 answer tokens.
REAL_VOCAB = (64001, 36096)


def run_cuda(steps: int = 10, micro: int = 3) -> dict:
    """Real-size model on a GPU: fp32, AMP, AMP + checkpointing (samples/s, peak allocated memory).

    `static_gb` is what stays allocated between steps (weights + AdamW state); `activation_gb` is the peak above
    it (activations, gradients, logits): the part AMP and checkpointing act on."""
    from relay.kernel.recipes import vqa_data

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        vqa_data.generate(Path(tmp), 3 * micro, 2, 0, 384, seed=0, noise=0.1, logits_fraction=0.5)
        recipe = _recipe("vqa-t4.yaml", Path(tmp))
        ds = recipe.train_dataset()
        batch = recipe.collate([ds[i] for i in range(micro)])
        long = torch.randint(5, 20, (micro, 160))  # the seed's 160-token answers
        batch["labels"] = long
        batch["soft_ids"] = torch.zeros((micro, 160, batch["soft_ids"].shape[-1]), dtype=torch.long)
        batch["soft_logits"] = torch.full_like(batch["soft_ids"], -1e4, dtype=torch.float32)
        batch["answer_len"] = torch.full((micro,), 160)
        batch["question_ids"] = torch.randint(5, 20, (micro, 64))  # questions at question_max_len
        batch["question_mask"] = torch.ones_like(batch["question_ids"])
        for name, amp, ckpt in (("fp32", False, False), ("amp", True, False), ("amp_ckpt", True, True)):
            model, opt = _models(recipe, ckpt, "cuda", REAL_VOCAB)
            scaler = torch.amp.GradScaler("cuda", enabled=amp)
            _steps(recipe, model, opt, [batch] * 2, "cuda", amp, scaler)
            for _ in range(30):  # GradScaler skips the steps its first scales overflow: AdamW's state is not there yet
                if opt.state:
                    break
                _steps(recipe, model, opt, [batch], "cuda", amp, scaler)
            torch.cuda.synchronize()
            static = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            _steps(recipe, model, opt, [batch] * steps, "cuda", amp, scaler)
            torch.cuda.synchronize()
            out[f"vqa_gpu_{name}_samples_per_s"] = round(steps * micro / (time.perf_counter() - t0), 2)
            peak = torch.cuda.max_memory_allocated()
            out[f"vqa_gpu_{name}_peak_gb"] = round(peak / 2**30, 2)
            out[f"vqa_gpu_{name}_static_gb"] = round(static / 2**30, 2)
            out[f"vqa_gpu_{name}_activation_gb"] = round((peak - static) / 2**30, 2)
            out["vqa_gpu_params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
            del model, opt
            torch.cuda.empty_cache()
    for name in ("amp", "amp_ckpt"):  # against fp32: the seed's claims are AMP ~40 % less memory, checkpointing
        # 30-40 % less at ~20 % more time (its T4 figures; the ratios, not the absolute numbers, carry over)
        for what in ("peak", "activation"):
            out[f"vqa_gpu_{name}_{what}_vs_fp32"] = round(out[f"vqa_gpu_{name}_{what}_gb"] / out[f"vqa_gpu_fp32_{what}_gb"], 3)
        out[f"vqa_gpu_{name}_time_vs_fp32"] = round(out["vqa_gpu_fp32_samples_per_s"] / out[f"vqa_gpu_{name}_samples_per_s"], 3)
    out["vqa_gpu_ckpt_activation_vs_amp"] = round(out["vqa_gpu_amp_ckpt_activation_gb"] / out["vqa_gpu_amp_activation_gb"], 3)
    out["vqa_gpu_ckpt_time_vs_amp"] = round(out["vqa_gpu_amp_samples_per_s"] / out["vqa_gpu_amp_ckpt_samples_per_s"], 3)
    out["vqa_gpu_device"] = torch.cuda.get_device_name(0)
    out["vqa_gpu_torch"] = torch.__version__
    return out


PHASES = ("setup", "preflight_train", "preflight_eval", "train", "eval", "save")
TRAINED = ("setup", "train", "eval", "save")  # what the session itself ran; the pre-flight must bound their peak


def _env() -> dict:
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))  # carried wheels stay
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


RELAY = [sys.executable, "-m", "relay"]


@contextlib.contextmanager
def _workspace(out_dir: Path | None):
    """(a temporary folder holding `relay data vqa` data, the logs' folder, the children's environment, None), or
    what went wrong as the last item when the data could not be made (said, not raised: the caller prints it).
    The data: 240 train questions (26 steps an epoch at 9), 8 val (the real eval at answer length, 2 batches)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        logs = Path(out_dir) if out_dir else tmp
        logs.mkdir(parents=True, exist_ok=True)
        env = _env()
        made = subprocess.run([*RELAY, "data", "vqa", "--out", str(tmp / "data"), "--val", "8", "--test", "4"],
                              env=env, capture_output=True, text=True, cwd=REPO)
        yield tmp, logs, env, f"rc={made.returncode}: {(made.stdout + made.stderr)[-1500:]}" if made.returncode else None


def _spec(spec_file: str, tmp: Path, name: str, optim: dict, session: dict | None = None) -> Path:
    """examples/`spec_file` with `optim` and `session` changes, one save kept (no second multi-GB write) and no
    best checkpoint, written to tmp/`name`.yaml."""
    raw = yaml.safe_load((REPO / "examples" / spec_file).read_text())
    raw["params"]["data_dir"] = str(tmp / "data")
    raw.setdefault("optim", {}).update(optim)
    raw.setdefault("session", {}).update(session or {})
    raw.setdefault("checkpoints", {}).update(keep_best=False, keep_last=1)
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(raw))
    return spec


def run_preflight(steps: int = 12, out_dir: Path | None = None, modes: tuple[str, ...] = ("none", "t4"),
                  spec_file: str = "vqa-t4.yaml") -> dict:
    """The real-size VQA student trained by `relay train` for `steps` steps (an eval at steps/2 and at the end,
    the final save), once per mode of RELAY_EMULATE_GPU, the sessions at once (one GPU; a process each: the T4
    cap is per process). Per mode: each phase's peak allocated and reserved MB, the pre-flight's figure and
    `ratio` = figure / the trained peak (setup, train, eval, save): >= 1 the pre-flight bounds the session."""
    out: dict = {}
    with _workspace(out_dir) as (tmp, logs, env, failed):
        if failed:
            return {"vqa_preflight_data_failed": failed}
        spec = _spec(spec_file, tmp, "vqa-real", {"eval_every_steps": max(1, steps // 2)})
        procs = {}
        for mode in modes:
            log = open(logs / f"vqa-preflight-{mode}.log", "w")
            procs[mode] = (subprocess.Popen(
                [*RELAY, "train", str(spec), "--workdir", str(tmp / f"w-{mode}"), "--budget", "none",
                 "--max-steps", str(steps), "--data", str(tmp / "data")],
                env={**env, "RELAY_EMULATE_GPU": mode}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log)
        for mode, (proc, log) in procs.items():
            rc = proc.wait()
            log.close()
            text = (logs / f"vqa-preflight-{mode}.log").read_text(errors="replace")
            out[f"vqa_preflight_{mode}_rc"] = rc
            out[f"vqa_preflight_{mode}_lines"] = [line[line.find("pre-flight"):][:200] for line in text.splitlines()
                                                  if "pre-flight" in line or "out of memory" in line]
            progress = tmp / f"w-{mode}" / "progress.json"
            if rc or not progress.exists():
                out[f"vqa_preflight_{mode}_tail"] = text[-1500:]
                continue
            (logs / f"vqa-preflight-{mode}-progress.json").write_text(progress.read_text())  # the record, kept
            p = json.loads(progress.read_text())
            rec = p["sessions"][-1]
            alloc, reserved = rec.get("phase_peaks_mb", {}), rec.get("phase_reserved_mb", {})
            trained = max((alloc[k] for k in TRAINED if k in alloc), default=0.0)
            figure = rec.get("preflight_mb")
            out[f"vqa_preflight_{mode}"] = {
                "precision": p.get("precision"), "micro_batch": p.get("micro_batch"), "grad_accum": p.get("grad_accum"),
                "steps": p.get("global_step"), "samples_per_s": rec.get("samples_per_s"),
                "preflight_mb": figure, "trained_peak_mb": trained, "peak_mem_mb": rec.get("peak_mem_mb"),
                "ratio": round(figure / trained, 3) if figure and trained else None,
                "phases_mb": {k: alloc.get(k) for k in PHASES}, "reserved_mb": {k: reserved.get(k) for k in PHASES},
                "memory_rungs": rec.get("memory_rungs", []), "emulated": rec.get("emulated")}
    return out


def run_backoff(steps: int = 6, micro: int = 24, out_dir: Path | None = None, spec_file: str = "vqa-t4.yaml",
                emulate: str = "t4") -> dict:
    """The OOM ladder on a T4's memory and the exact resume after it (issue 48 part 2): the real-size VQA student
    at micro-batch `micro` x 1 without activation checkpointing (more than a T4's 15 GB hold, so the pre-flight
    backs off), as a T4 (session.emulate), through `relay verify-resume --steps N --cut-at N/2`: N steps
    straight against sessions cut at N/2, the second killed mid-save. Figures: per session of each run the
    micro-batch it trained at, the rungs it took, its pre-flight figure and peak; the verdict."""
    out: dict = {}
    with _workspace(out_dir) as (tmp, logs, env, failed):
        if failed:
            return {"vqa_backoff_data_failed": failed}
        spec = _spec(spec_file, tmp, "vqa-backoff",
                     {"micro_batch": micro, "grad_accum": 1, "activation_checkpointing": False,
                      "eval_every_steps": steps},
                     {"emulate": None if emulate == "none" else emulate})
        env.pop("RELAY_EMULATE_GPU", None)  # the spec's session.emulate decides
        t0 = time.monotonic()
        done = subprocess.run([*RELAY, "verify-resume", str(spec), "--steps", str(steps), "--cut-at",
                               str(steps // 2), "--workdir", str(tmp / "verify")],
                              env=env, capture_output=True, text=True, cwd=REPO)
        (logs / "vqa-backoff.log").write_text(done.stdout + done.stderr)
        out["vqa_backoff_rc"] = done.returncode
        out["vqa_backoff_verdict"] = done.stdout.strip()[-600:] or done.stderr.strip()[-1500:]
        out["vqa_backoff_seconds"] = round(time.monotonic() - t0, 1)
        for run in ("straight", "split"):
            progress = tmp / "verify" / run / "progress.json"
            if not progress.exists():
                continue
            p = json.loads(progress.read_text())
            out[f"vqa_backoff_{run}"] = {
                "precision": p.get("precision"), "steps": p.get("global_step"), "emulate": emulate,
                "ends_at": f"micro-batch {p.get('micro_batch')} x {p.get('grad_accum')}",
                "sessions": [{k: s.get(k) for k in ("step_start", "step_end", "stop_reason", "memory_rungs",
                                                      "preflight_mb", "peak_mem_mb", "emulated")}
                             for s in p.get("sessions", [])]}
    return out


def print_preflight(figures: dict) -> None:
    """One compact table per mode: phase, peak allocated / reserved MB, and the pre-flight's ratio."""
    for key, f in figures.items():
        if not isinstance(f, dict):
            print(f"{key}: {f}")
            continue
        print(f"{key}: {f['precision']} micro-batch {f['micro_batch']} x {f['grad_accum']}, {f['steps']} steps, "
              f"{f['samples_per_s']} samples/s, as {f['emulated'] or 'itself'}, rungs {f['memory_rungs']}")
        for phase in PHASES:
            print(f"  {phase:16s} {f['phases_mb'][phase]!s:>9} MB alloc  {f['reserved_mb'][phase]!s:>9} MB reserved")
        print(f"  pre-flight {f['preflight_mb']} MB / trained peak {f['trained_peak_mb']} MB = ratio {f['ratio']} "
              "(goal 1.0-1.1)")


def print_backoff(figures: dict) -> None:
    """The verdict, then a line per session of each run: its steps, the micro-batch rungs it took, its peaks."""
    print(f"vqa back-off: rc={figures.get('vqa_backoff_rc')} {figures.get('vqa_backoff_seconds')} s; verdict: "
          + str(figures.get("vqa_backoff_verdict", figures)).replace("\n", " /"))
    for run in ("straight", "split"):
        f = figures.get(f"vqa_backoff_{run}")
        if not f:
            continue
        print(f"  {run}: {f['precision']} as {f['emulate']}, {f['steps']} steps, ends at {f['ends_at']}")
        for s in f["sessions"]:
            print(f"    {s['step_start']}->{s['step_end']} ({s['stop_reason']}): rungs {s['memory_rungs'] or []},"
                  f" pre-flight {s['preflight_mb']} MB, peak {s['peak_mem_mb']} MB, as {s['emulated'] or 'itself'}")


def run(steps: int = 20, repeats: int = 3) -> dict:
    figures = run_cpu(steps, repeats)
    if torch.cuda.is_available():
        figures.update(run_cuda())
        figures.update(run_preflight())
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preflight", action="store_true", help="only the pre-flight vs session peaks (CUDA)")
    ap.add_argument("--backoff", action="store_true",
                    help="only the OOM back-off on a T4's memory and the exact resume after it (CUDA)")
    ap.add_argument("--spec", default="vqa-t4.yaml", help="the example spec of --preflight and --backoff")
    ap.add_argument("--micro", type=int, default=24, help="--backoff: the micro-batch it starts at (x 1)")
    ap.add_argument("--emulate", default="t4", help="--backoff: the GPU to run as (none: as itself)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the sessions' logs")
    a = ap.parse_args()
    if a.preflight:
        print_preflight(run_preflight(out_dir=a.out, spec_file=a.spec))
        return
    if a.backoff:
        print_backoff(run_backoff(micro=a.micro, out_dir=a.out, spec_file=a.spec, emulate=a.emulate))
        return
    print(json.dumps(run(a.steps, a.repeats), indent=1))


if __name__ == "__main__":
    main()
