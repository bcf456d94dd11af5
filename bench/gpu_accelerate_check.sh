#!/usr/bin/env bash
# The Accelerate integration's CUDA path on a lent GPU machine (no CI runs there): the in-process split-vs-
# straight test with fp16 (Accelerate's GradScaler packed and restored; --noconftest: the image lacks the
# emulator's packages), then `relay verify-resume` of examples/byo-accelerate with --mixed-precision fp16.
# Run from the repo root: `bash bench/gpu_accelerate_check.sh OUT`.
set -uo pipefail
if [ -d .whl ] && ! python3 -c 'import pydantic' 2>/dev/null; then  # the GPU image lacks pydantic (bench/gpu_check.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
out=${1:-/tmp/gpu-accelerate}
mkdir -p "$out"
python3 -c 'import torch, accelerate; print("torch", torch.__version__, "accelerate", accelerate.__version__, torch.cuda.get_device_name(0))'
python3 -m pytest -q -p no:cacheprovider --noconftest tests/kernel/test_byo_accelerate.py -k "split_run" 2>&1 | tail -5
work=$(mktemp -d)
cp -r examples/byo-accelerate "$work/ex"
sed -i 's/entry: train.py/entry: train.py --mixed-precision fp16/' "$work/ex/spec.yaml"
t0=$SECONDS
python3 -m relay verify-resume "$work/ex/spec.yaml" --steps 24 --workdir "$work/v" >"$out/byo-accelerate-fp16.log" 2>&1
echo "byo-accelerate fp16 verify-resume: rc=$? $((SECONDS - t0)) s: $(tail -3 "$out/byo-accelerate-fp16.log" | tr '\n' ' ')"
