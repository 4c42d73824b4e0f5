"""Fused Triton kernels for the GPU path (RMSNorm, rotary embedding, SiLU-and-mul).

`pellucid.models.layers` calls them behind its plain torch functions when `fused_kernels_enabled`
says so for the tensor's device; the CPU always runs the torch code. Set PELLUCID_FUSED_KERNELS=0 to
run the plain torch path on the GPU too, to `all`, or to a comma-separated subset of KERNELS to enable
only those (the benchmarks use this to measure what each fusion buys); unset means DEFAULT_KERNELS.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


KERNELS = ("rms_norm", "rotary", "silu_and_mul")
# On by default: the fusions that measured faster (H100, Qwen3-0.6B shape, CUDA-graph decode, batch 1:
# 4.41 ms/step unfused, 3.02 with rms_norm alone, 3.64 with rotary alone, 4.61 with silu_and_mul alone,
# which is no gain over noise, so silu_and_mul stays opt-in: PELLUCID_FUSED_KERNELS=all).
DEFAULT_KERNELS = ("rms_norm", "rotary")


@functools.lru_cache(maxsize=8)
def _enabled_kernels(setting: str) -> frozenset[str]:
    if setting in ("1", "default"):
        return frozenset(DEFAULT_KERNELS)
    if setting == "all":
        return frozenset(KERNELS)
    if setting in ("0", "none", ""):
        return frozenset()
    names = frozenset(name.strip() for name in setting.split(","))
    unknown = names - set(KERNELS)
    if unknown:
        raise ValueError(f"PELLUCID_FUSED_KERNELS names unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    return names


def fused_kernels_enabled(x: torch.Tensor, kernel: str) -> bool:
    """True when x lives on a CUDA device, Triton imports and PELLUCID_FUSED_KERNELS enables `kernel`."""
    if not x.is_cuda:
        return False
    return kernel in _enabled_kernels(os.environ.get("PELLUCID_FUSED_KERNELS", "1")) and _triton_available()
