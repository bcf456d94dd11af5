"""Why the VQA eval sums its cross-entropy by hand (CUDA only; ~5 s): the same logits' mean loss, 30 times.

`F.cross_entropy(logits, labels)` over a (batch, vocab, length) input reduces with atomics across CUDA blocks
(`nll_loss2d_forward_out_cuda_template`, which torch.use_deterministic_algorithms names), so one eval can come out
1 ulp apart in two processes, and `relay verify-resume` compares the eval loss a checkpoint keeps. The sum of
`reduction="none"` over the count of labelled tokens is one value every time. The VQA student's shapes: eval
batch 16, T5's 36096-token vocabulary, 160-token answers (40 of them padding). Run: `python
bench/gpu_eval_determinism.py` (in `bash bench/gpu_check.sh OUT backoff`).
"""
import sys
import warnings

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("bench/gpu_eval_determinism.py: no CUDA device here (the atomics are CUDA's)")
g = torch.Generator("cuda").manual_seed(0)
logits = torch.randn(16, 36096, 160, device="cuda", generator=g)
labels = torch.randint(0, 36096, (16, 160), device="cuda", generator=g)
labels[:, 120:] = -100
means = {float(F.cross_entropy(logits, labels, ignore_index=-100)) for _ in range(30)}
by_hand = {float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="none").sum() / (labels != -100).sum())
           for _ in range(30)}
print(f"cross_entropy's mean over (16, 36096, 160) on {torch.cuda.get_device_name(0)}, 30 times: {len(means)} distinct"
      f" value(s); summed by hand (reduction none, sum / count): {len(by_hand)}")
torch.use_deterministic_algorithms(True, warn_only=True)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    F.cross_entropy(logits, labels, ignore_index=-100)
print("deterministic mode says:", "; ".join(str(w.message).split(",")[0] for w in seen) or "nothing")
