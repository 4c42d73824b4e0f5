"""Fused Triton kernels for the GPU path (RMSNorm, rotary embedding, SiLU-and-mul, residual add +
RMSNorm, Qwen3 q/k norm + rotary, skinny decode GEMMs, mixture-of-experts, code2wav's SnakeBeta).

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


KERNELS = ("rms_norm", "rotary", "silu_and_mul", "add_rms_norm", "qk_norm_rotary", "skinny_gemm", "skinny_silu_down",
           "rotary_kv_store", "skinny_qkv_rotary", "skinny_gate_up_silu", "argmax", "moe", "snake_beta",
           "top_k_race", "attention_qk_norm_rotary", "add_rms_norm_top_k", "tp_all_reduce_add_rms_norm", "fp8_linear")
# Each measured on an H100 (2026-11-23), Qwen3-0.6B shape, bf16, GPU time of one CUDA-graph decode
# forward at batch 1 / 64 / 256 (pellucid bench latency, "graph forward ms"): none fused 3.98 / 4.90 ms;
# rms_norm alone 2.52 / 3.15; rotary alone 3.18 / 4.04; silu_and_mul alone 3.94 / 4.85; all three
# 1.67 / 2.21 / 2.86 against rms_norm + rotary 1.72 / 2.26 / 2.96 (silu_and_mul: 3% on top).
# add_rms_norm (residual add fused into the next RMSNorm) and qk_norm_rotary (Qwen3 q/k norm fused into
# rotary) cut launches per decoder layer; benchmarks/gpu_issue4.sh section `merged` measures them.
# skinny_gemm runs decode-sized projections (M <= skinny_gemm.MAX_ROWS rows) as Triton GEMMs instead of
# cuBLAS; skinny_silu_down fuses silu(gate) * up into the down projection's skinny GEMM (per-shape
# numbers: benchmarks/skinny_gemm_bench.py). H100 (2026-11-23), Qwen3-0.6B, graph forward at batch 1 / 8:
# both on 1.094 / 1.311 ms (793 tok/s at batch 1) against both off 1.233 / 1.303 ms (715 tok/s).
# rotary_kv_store: the rotary (or q/k norm + rotary) kernel stores K/V in the cache, no KV-write launch
# (pellucid.attention.fused_kv_store); measured in BENCHMARKS.md, round 5.
# skinny_qkv_rotary / skinny_gate_up_silu: rotary (+ the K/V store) and SiLU-and-mul as epilogues of the
# q/k/v and gate/up skinny GEMMs (pellucid.kernels.skinny_paired); argmax: greedy sampling's argmax as one
# multi-program kernel (pellucid.kernels.argmax). Measured in BENCHMARKS.md, issue 4 round 7.
# moe: mixture-of-experts routing and experts as fused Triton kernels (pellucid.kernels.fused_moe); without
# it, CUDA runs every expert on every token (a debugging path; BENCHMARKS.md, issue 19).
# snake_beta: Qwen3-Omni code2wav's activation in one pass instead of seven launches (BENCHMARKS.md, issue 20).
# top_k_race: the code predictor's draw of each code (argmax, or the race over its top-k / top-p set) in one
# launch instead of a dozen (pellucid.kernels.top_k_race; BENCHMARKS.md, issue 20).
# attention_qk_norm_rotary: in decode steps the attention kernel applies Qwen3's q/k norm + rotary and stores
# the new K/V itself (pellucid.attention.norm_rotary); measured in BENCHMARKS.md, issue 19, round 7.
# add_rms_norm_top_k: a mixture of experts hands its weighted expert rows to the residual add + RMSNorm after
# it, which sums them (pellucid.models.layers.TopKRowsMlp): no top-k sum launch; BENCHMARKS.md, issue 19, round 8.
# tp_all_reduce_add_rms_norm: under tensor parallelism with --all-reduce symm_mem, a row-parallel projection's
# all-reduce, the residual add and the RMSNorm after it in one kernel (pellucid.distributed.fused_all_reduce).
# fp8_linear: projections kept as float8 codes with block scales multiply them in Triton kernels that dequantize as
# they read (pellucid.kernels.fp8_linear); without it they dequantize the whole weight at every call in torch.
DEFAULT_KERNELS = KERNELS


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
