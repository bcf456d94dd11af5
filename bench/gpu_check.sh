#!/usr/bin/env bash
# The CUDA paths on a lent GPU machine (no CI runs there): every tiny spec trained by `relay train`, the
# plain-loop example with AMP relayed over sessions by `relay verify-resume`, the HF and Lightning examples likewise.
# Run from the repo root: `bash bench/gpu_check.sh OUT_DIR [SECTION ...]`, sections `tiny vqa backoff ratio loop
# exact` (all but `ratio`, which `loop` includes, by default; the whole takes over 10 minutes on an H100, so a lent
# machine's one call picks some). Issue 48's figures: `ratio` alone on a quiet GPU (~4 min on an H200: the three
# models ~2 min, the MLP at log_every 10 ~40 s, the ablation ~70 s), `vqa backoff` (at once, ~3 min on an H200),
# `loop` (~3.5 min); `exact` alone took 5.5 minutes there: a call of its own. Each run's progress.json summary and
# wall time are printed; logs go to OUT_DIR. On a CPU-only machine the
# same commands take the CPU paths.
set -uo pipefail
# The lent GPU image lacks pydantic: carry its wheels (`.whl/`, ignored by git; fetched with `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4
# pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5`) and install them first:
if [ -d .whl ] && ! python3 -c 'import pydantic' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${1:-/tmp/gpu-check}
mkdir -p "$out"
sections=("${@:2}")
[ ${#sections[@]} -eq 0 ] && sections=(tiny vqa backoff loop exact)
want() { [[ " ${sections[*]} " == *" $1 "* ]]; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
relay=("$py" -m relay)
work=$(mktemp -d)

"$py" - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

summary() {  # name, workdir, seconds
  "$py" - "$@" <<'EOF'
import json, sys
name, wd, secs = sys.argv[1:4]
p = json.load(open(f"{wd}/progress.json"))
keep = {k: p.get(k) for k in ("status", "global_step", "epoch", "gpus", "precision", "device", "weights_sha256")}
keep["weights_sha256"] = (keep["weights_sha256"] or "")[:12]
print(f"{name}: {float(secs):.1f} s", json.dumps(keep), json.dumps(p.get("metrics", {}))[:300])
EOF
}

run_tiny() {  # recipe-data-name spec
  local data=$1 spec=$2 name
  name=$(basename "$spec" .yaml)
  "${relay[@]}" data "$data" --out "data/${spec_data[$name]}" >"$out/$name-data.log" 2>&1 || { echo "$name: data FAILED"; tail -3 "$out/$name-data.log"; return; }
  local t0=$SECONDS
  if "${relay[@]}" train "$spec" --workdir "$work/$name" --budget none >"$out/$name.log" 2>&1; then
    summary "$name" "$work/$name" $((SECONDS - t0))
  else
    echo "$name: FAILED rc=$?"; tail -5 "$out/$name.log"
  fi
}

declare -A spec_data=([price-tiny]=price [vqa-tiny]=vqa [legal-tiny]=legal [temporal-tiny]=temporal [recsys-tiny]=recsys)
if want tiny; then
  run_tiny price-model examples/price-tiny.yaml
  run_tiny vqa examples/vqa-tiny.yaml
  run_tiny legal examples/legal-tiny.yaml
  run_tiny temporal examples/temporal-tiny.yaml
  run_tiny recsys examples/recsys-tiny.yaml
fi

# The pre-flight's figure against the session's peak per phase (issue 48): the real-size VQA student
# (examples/vqa-t4.yaml on `relay data vqa` data) for 12 steps with an eval and a save, as this GPU and as a T4
# (RELAY_EMULATE_GPU=t4: 15102 MiB cap, fp16 + GradScaler), both sessions at once (~2-3 min on an H100).
# The OOM ladder on a T4's memory and the exact resume after it (issue 48 part 2): the same student as a T4 at
# micro-batch 24 x 1 without activation checkpointing, split by verify-resume (one session killed mid-save), in the
# background beside the pre-flight sessions (each process is capped at 15 GB; their speeds are not the figures).
if want backoff; then
  (t0=$SECONDS
   "$py" bench/bench_vqa.py --backoff --out "$out" >"$out/vqa-backoff.out" 2>"$out/vqa-backoff.err"
   echo "rc=$? $((SECONDS - t0)) s" >>"$out/vqa-backoff.out") &
  backoff_pid=$!
fi
if want vqa; then
  t0=$SECONDS
  "$py" bench/bench_vqa.py --preflight --out "$out" 2>"$out/vqa-preflight.err" || { echo "vqa pre-flight: FAILED"; tail -5 "$out/vqa-preflight.err"; }
  echo "vqa pre-flight vs session peaks: $((SECONDS - t0)) s (logs $out/vqa-preflight-*.log)"
fi
if want backoff; then
  wait "$backoff_pid"
  cat "$out/vqa-backoff.out"; tail -5 "$out/vqa-backoff.err"
  "$py" bench/gpu_eval_determinism.py  # why the VQA eval sums its loss by hand: cross_entropy's mean uses atomics
fi

# What the Session API's step costs beside two hand-written loops' (issue 48: <= 1.03x at ~2 ms steps), ~2.5 min;
# `ratio` runs this alone (the first thing to run on a lent GPU: nothing else on it while it runs), `loop` runs it
# and then the built-in loop's figures.
if want ratio || want loop; then
  t0=$SECONDS
  "$py" bench/bench_step_overhead.py --device cuda >"$out/step-overhead.log" 2>&1
  echo "step overhead, Session API vs hand-written: rc=$? $((SECONDS - t0)) s:"
  grep -E '^(GPU|tiny|mlp|transformer)|process' "$out/step-overhead.log"
  # the same at the old default log_every 10 (a window read every 10 steps), the MLP only (~40 s)
  "$py" bench/bench_step_overhead.py --device cuda --only mlp --log-every 10 >"$out/step-overhead-log10.log" 2>&1
  echo "  at log_every 10: $(grep -E '^mlp' "$out/step-overhead-log10.log")"
  # each closed window goes through the session's one pinned buffer and event (the conftest needs Prefect: none)
  "$py" -m pytest --noconftest -p no:cacheprovider -q tests/kernel/test_step_done_reads.py -k cuda_windows 2>&1 | tail -1
  # what each part of the Session API's step costs at the MLP's ~2 ms step (~45 s estimated from its step count)
  "$py" bench/session_ablation.py --device cuda --only mlp --steps 500 --rounds 5 2>"$out/ablation.err" | grep -v '^{'
fi
if want loop; then
  # the built-in loop against the same loop by hand and HF's Trainer on the GPU (a small model's short steps)
  t0=$SECONDS
  "$py" bench/bench_loop.py --device cuda >"$out/loop-builtin.log" 2>&1
  echo "built-in loop vs hand-written and HF Trainer on CUDA: rc=$? $((SECONDS - t0)) s:"
  grep -E '"loop_(device|relay_vs_(hand|hf)(_wall|_cpu)?|(relay|hand|hf)_s)"' "$out/loop-builtin.log"
  # where either loop waits on the GPU: host-device syncs per step by relay line (saves, evals; the built-in
  # loop's log steps)
  "$py" bench/gpu_syncs.py 2>"$out/gpu-syncs.err" | grep -v relay-progress
  # where the Session API's step goes at ~2 ms steps: hand-written forms with a sync or a window read, and the
  # host's microseconds inside the relay's calls (~1 min)
  "$py" bench/step_split.py --device cuda --only mlp 2>"$out/step-split.err" | grep -v '^{'
fi

# The plain loop with fp16 autocast + GradScaler, split into sessions (one killed mid-save) vs one run.
want exact || { rm -rf "$work"; exit 0; }
sed 's/entry: train.py --lr 0.003/entry: train.py --lr 0.003 --amp/' examples/byo-plain/spec.yaml >examples/byo-plain/spec-amp.yaml
t0=$SECONDS
"${relay[@]}" verify-resume examples/byo-plain/spec-amp.yaml --steps 120 >"$out/byo-plain-amp.log" 2>&1
echo "byo-plain --amp verify-resume: rc=$? $((SECONDS - t0)) s: $(tail -2 "$out/byo-plain-amp.log" | tr '\n' ' ')"
rm -f examples/byo-plain/spec-amp.yaml
t0=$SECONDS
"${relay[@]}" verify-resume examples/byo-hf/spec.yaml --steps 40 >"$out/byo-hf.log" 2>&1
echo "byo-hf verify-resume: rc=$? $((SECONDS - t0)) s: $(tail -2 "$out/byo-hf.log" | tr '\n' ' ')"
t0=$SECONDS
"${relay[@]}" verify-resume examples/byo-lightning/spec.yaml --steps 40 >"$out/byo-lightning.log" 2>&1
echo "byo-lightning verify-resume: rc=$? $((SECONDS - t0)) s: $(tail -2 "$out/byo-lightning.log" | tr '\n' ' ')"
rm -rf "$work"
