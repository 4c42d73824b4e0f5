"""Dense linear layers kept in FP8, as a block-wise FP8 checkpoint stores them.

A block-wise FP8 checkpoint (quant_method "fp8", float8 e4m3 with a `weight_block_size` [bn, bk], as the official
Qwen3-*-FP8 ship) stores each quantized projection as codes `X.weight` [N, K] with float32 scales
`X.weight_scale_inv` [N / bn, K / bk]. A `Linear` (pellucid.models.layers) whose weight has scales in the checkpoint
keeps both (`Linear.keep_fp8`): half the memory of bf16, and half the bytes a decode step reads for it. vLLM keeps
these checkpoints' linear weights in FP8 too.

Every use multiplies the load-time dequantizer's values (quantized_checkpoint.py): code * its block's scale in
float32, rounded once to the model's dtype. On the CPU the torch path dequantizes the weight and runs the same
`nn.functional.linear`, so the model computes what the fully dequantized checkpoint computes, bit for bit. On CUDA
the Triton kernels of pellucid.kernels.fp8_linear dequantize as they read (activations stay in the model's dtype:
W8A16); their float32 sums run in another order than cuBLAS's (the GPU checks bound the difference).

It is opt-in: PELLUCID_FP8_LINEAR=1. Measured on an H200 (BENCHMARKS.md, "FP8 projections"): one projection at one
row (batch-1 decode) takes 0.68-0.81x of bf16's time, but mostly 1.0-2.7x from 2 to 127 rows (Triton's tensor-core
kernels convert 8-bit operands well below the bandwidth the bytes allow) and 1.0-2.6x from 128 (dequantize +
cuBLAS). In the engine, Llama-3.1-8B's batch-1 decode step takes 0.72x of the dequantized model's, its batch-64 step
1.99x, an 8k prefill 1.01x; Qwen3-30B-A3B's batch-1 step takes 1.23x, because its expert GEMMs run slower beside
the FP8 projections' early-launched programs (not understood yet). So it trades throughput for memory
(Llama-3.1-70B's weights: ~73 GB instead of ~141) and a dense model's batch-1 latency; by default the projections
are dequantized at load, as every other 8-bit weight, and the loader's warning says how to keep them.

With it on, a projection stays in FP8 when the checkpoint has its scales (for a random-weights benchmark shape:
every `Linear` the config's `modules_to_not_convert` does not name), its blocks tile its weight (and, under tensor
parallelism, each rank's part of it), and projections sharing one merged GEMM (q/k/v, gate/up) can all stay.
Otherwise it is dequantized at load; the loader's warning says how much stayed in FP8. The mixture-of-experts
weights have their own switch (pellucid.models.fp8_experts, PELLUCID_FP8_EXPERTS, on by default: their kernels
are as fast in FP8). The LM head and the embeddings are never quantized in these checkpoints.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch
from torch import nn

from pellucid.kernels import fused_kernels_enabled
from pellucid.models.fp8_experts import SCALE_SUFFIX, _quantization_config, dequantize


def fp8_linears_enabled() -> bool:
    """PELLUCID_FP8_LINEAR: "1" keeps FP8 projections in FP8, "0" (the default) dequantizes them at load."""
    setting = os.environ.get("PELLUCID_FP8_LINEAR", "0").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"PELLUCID_FP8_LINEAR must be 0 or 1, got {setting!r}")
    return setting == "1"


def checkpoint_fp8_block(hf_config: Any) -> tuple[int, int] | None:
    """The [bn, bk] block of a block-wise FP8 e4m3 checkpoint whose projections may stay in FP8, else None."""
    quantization = _quantization_config(hf_config)
    if quantization is None or not fp8_linears_enabled():
        return None
    block = quantization.get("weight_block_size")
    if (quantization.get("quant_method") != "fp8" or quantization.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, (list, tuple)) or len(block) != 2):
        return None
    return int(block[0]), int(block[1])


def not_converted(hf_config: Any, module_name: str) -> bool:
    """Whether the config's modules_to_not_convert names this module (transformers matches by substring)."""
    skipped = (_quantization_config(hf_config) or {}).get("modules_to_not_convert") or ()
    return any(name and (name in module_name or module_name in name) for name in skipped)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequantized(weight)^T + bias (module docstring): the Triton kernels on CUDA, else the torch path."""
    if x.dim() != 2:
        return fp8_linear(x.reshape(-1, x.shape[-1]), weight, scale, bias).reshape(*x.shape[:-1], weight.shape[0])
    if fused_kernels_enabled(x, "fp8_linear") and x.stride(-1) == 1:
        from pellucid.kernels.fp8_linear import fp8_linear_cuda
        return fp8_linear_cuda(x, weight, scale, bias)
    return nn.functional.linear(x, dequantize(weight, scale, x.dtype), bias)


def keep_fp8_linears(model: nn.Module, hf_config: Any, quantized: set[str] | None) -> int:
    """Turn the model's eligible `Linear` projections (module docstring) into FP8 ones, before it is materialized.
    `quantized`: the parameter names whose checkpoint tensors have scales (None for drawn random weights, where
    the config decides). Returns how many projections stay in FP8."""
    from pellucid.models.layers import Linear, MergedLinear

    block = checkpoint_fp8_block(hf_config)
    if block is None:
        return 0
    names = {module: name for name, module in model.named_modules()}

    def eligible(linear: nn.Module) -> bool:
        name = names.get(linear)
        if not isinstance(linear, Linear) or name is None or name.rpartition(".")[2] == "lm_head":
            return False
        if quantized is not None and f"{name}.weight" not in quantized:
            return False
        return not (quantized is None and not_converted(hf_config, name)) and linear.fp8_fits(block)

    merged = [group for module in model.modules() for group in vars(module).values()
              if isinstance(group, MergedLinear)]
    in_groups = {linear for group in merged for linear in group.linears}
    chosen = [group.linears for group in merged if all(eligible(linear) for linear in group.linears)]
    chosen += [[module] for module in model.modules() if module not in in_groups and eligible(module)]
    for linears in chosen:
        for linear in linears:
            linear.keep_fp8(block)
    for group in merged:
        group.merge()
    return sum(len(linears) for linears in chosen)


def quantized_weight_names(checkpoint_names: Iterable[str], to_param_name: Any) -> set[str]:
    """The parameter names (`to_param_name(checkpoint name)`) of the checkpoint's weights that have scales."""
    return {to_param_name(name[:-len(SCALE_SUFFIX)]) for name in checkpoint_names if name.endswith(SCALE_SUFFIX)}
