"""What Kaggle's kernels service checks of a request before it acts on it, held to the public record: how a
version is named, what a kernel the caller may not see answers, the slug a title gives, which machine shapes run.
Each rule cites where it was read; where the record says nothing, the closest documented form is modelled and
the comment says so."""
from __future__ import annotations

import re
from typing import Optional

from relay.emulator.protocol import ApiError

# A kernel the caller cannot see (it does not exist, or it is another user's private one) answers 403, not 404:
# kaggle-cli PR #951 (a wrong slug on ListKernelSessionOutput / GetKernelSessionStatus "returns 403/401 instead of
# 404"; the client's handlers say "Permission 'kernels.get' was denied"), and GetKernel of the slug `slug/1`,
# which names no kernel, answers 403 (kaggle-cli #1200, PR #1201).
HIDDEN = "Permission 'kernels.get' was denied"


def hidden(ref: str) -> ApiError:
    return ApiError(403, f"{HIDDEN} on {ref}")


def version_number(label: Optional[str]) -> Optional[int]:
    """The version a request's versionLabel names, None for none (the current one). Kaggle takes `v<N>` only:
    GetKernel with versionLabel "v1" gives version 1, a bare "1" answers 404 (kaggle-cli PR #1201's table,
    reproduced on 2.2.4); the same label field is read by status and output listing."""
    if not label:
        return None
    match = re.fullmatch(r"v([1-9][0-9]*)", str(label))
    if match is None:
        raise ApiError(404, f"No kernel version {label!r} (a version label is v<N>)")
    return int(match.group(1))


def slug_from_title(title: str) -> str:
    """The slug Kaggle gives a new kernel: its title, slugified. The `kaggle` client predicts it with
    python-slugify's slugify(title) and only warns when it differs from the `id` pushed ("Your kernel title does
    not resolve to the specified id. This may result in surprising behavior": kaggle_api_extended.py
    kernels_push; kaggle-cli #847, #538), so the emulator uses the same function."""
    from slugify import slugify  # a dependency of the `kaggle` client

    return slugify(title)


def title_in_use(title: str) -> str:
    """The refusal of a title another kernel of the account already has. Kaggle's exact text for kernels is not
    in the record; this is the form it answers for datasets ('The requested title "X" is already in use by a
    dataset. Please choose another title.', kaggle-cli #243, PR #1180), as a push refusal (HTTP 200 with
    `error`; the CLI exits 0 on '"slug already in use"')."""
    return f'The requested title "{title}" is already in use by a notebook. Please choose another title.'


# machine_shape values Kaggle runs (kaggle-cli docs/kernels.md "Accelerators available as of Feb 2026", less the
# retired ones below; PR #1198: NvidiaTeslaT4 is "GPU T4 x2", TpuV5E8 is "TPU v5e-8"). Some are gated on
# competitions or admin status (the same doc); the emulator runs them all.
GPU_SHAPES = ("NvidiaTeslaT4", "NvidiaTeslaT4Highmem", "NvidiaTeslaA100", "NvidiaL4", "NvidiaL4X1", "NvidiaH100",
              "NvidiaRtxPro6000")
TPU_SHAPES = ("TpuV5E8", "TpuV6E8")
# Retired shapes are not refused: "the server silently runs the session on a replacement instead" (kaggle-cli
# PR #1192; tests/unit/test_kernels_push_retired_accelerator.py lists each with its replacement; None = CPU).
RETIRED = {"NvidiaTeslaP100": "NvidiaTeslaT4", "TpuV38": "TpuV5E8", "Tpu1VmV38": "TpuV5E8",
           "TpuV232": None, "TpuV2256": None,
           # "Gpu" asks for a kind, not a chip ("`--accelerator gpu` is a documented spelling", PR #1192); the
           # record does not say what it gets: modelled as the default GPU (NvidiaTeslaT4, PR #1198)
           "Gpu": "NvidiaTeslaT4"}
# enable_gpu without a shape has been served a P100 (kaggle-cli #821), whose compute fails on the cu128 image
# (#1151, PR #1156); the emulator keeps that pessimistic answer.
NO_SHAPE_GPU = "NvidiaTeslaP100"
# what a session on a shape sees (RELAY_TEST_HARDWARE), where it is not what was asked
SEEN_GPUS = {"NvidiaTeslaT4": ["Tesla T4", "Tesla T4"], "NvidiaTeslaP100": ["Tesla P100-PCIE-16GB"]}


def served_shape(shape: Optional[str], enable_gpu: bool, enable_tpu: bool) -> tuple:
    """(the shape a push runs on, None for CPU; its refusal, or None). An unknown shape is refused: Kaggle's
    form for that is not in the record, so it is modelled as a push refusal (HTTP 200 with `error`, the form
    SaveKernel refuses in) naming the field."""
    if not shape:
        return (NO_SHAPE_GPU if enable_gpu else "TpuV5E8" if enable_tpu else None), None
    for known in GPU_SHAPES + TPU_SHAPES:  # the client matches shapes case-insensitively (PR #1192's test)
        if shape.strip().lower() == known.lower():
            return known, None
    for retired, replacement in RETIRED.items():
        if shape.strip().lower() == retired.lower():
            return replacement, None
    return None, f"Invalid machine shape {shape!r}: expected one of {', '.join(GPU_SHAPES + TPU_SHAPES)}"


def is_gpu(shape: Optional[str]) -> bool:
    return shape in GPU_SHAPES or shape == NO_SHAPE_GPU
