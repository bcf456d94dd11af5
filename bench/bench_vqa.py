"""Benchmark: the VQA student's training step with and without activation checkpointing on the T5 decoder.

CPU (always): the tiny model of examples/vqa-tiny.yaml (ViT 32 px + BERT + T5, d=64) on synthetic data, the
FORMAT_LEARNING stage (full-length answers), micro-batch `--micro` forward + backward + AdamW, one torch thread.
Two models with the same initial weights, one with checkpointing; rounds alternate which goes first and the
figures are medians of process CPU seconds (wall in brackets). The ratio is what matters: the seed expects
checkpointing to cost ~20 % more time.

CUDA (only when a GPU is present; not run on the CPU-only development machine): the real-size model of
examples/vqa-t4.yaml at micro-batch 3: fp32 vs AMP vs AMP + checkpointing, samples/s and peak memory, against
the seed's claims (AMP ~40 % less memory, checkpointing 30-40 % less at ~20 % more time).
Run: `python bench/bench_vqa.py [--steps N --repeats N]`; `run()` returns the named figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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


def run(steps: int = 20, repeats: int = 3) -> dict:
    figures = run_cpu(steps, repeats)
    if torch.cuda.is_available():
        figures.update(run_cuda())
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(run(a.steps, a.repeats), indent=1))


if __name__ == "__main__":
    main()
