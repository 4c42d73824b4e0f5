"""Mixture-of-experts weights kept in FP8, as a block-wise FP8 checkpoint stores them.

A block-wise FP8 checkpoint (quant_method "fp8" with a `weight_block_size` [bn, bk], as the official
Qwen3-*-FP8 ship) holds each expert's weights as float8 e4m3 codes with one float32 scale per [bn, bk] block
(`X.weight_scale_inv`). The experts are almost all of a mixture of experts' weights (Qwen3-30B-A3B: 28.3B of its
30.5B parameters), so `FusedExperts` keeps them so: half the memory of bf16, and half the expert bytes a decode
step reads. Parameters: `gate_up_proj` / `down_proj` in float8 e4m3 and `gate_up_proj_scale_inv` [E, 2I / bn,
H / bk] / `down_proj_scale_inv` [E, H / bn, I / bk] in float32.

Every use dequantizes a weight as it reads it: code * its block's scale in float32, rounded once to the model's
dtype. Those are the values the load-time dequantizer (quantized_checkpoint.py) gives, so the model computes what
the same checkpoint fully dequantized computes: bit for bit on the CPU (the torch paths dequantize one expert at a
time) and in float32 on the GPU; in 16-bit dtypes on the GPU the expert GEMMs, which dequantize each weight tile
in registers (pellucid.kernels.moe_gemm), sum their products in another order, so results differ by float32
summation rounding (the GPU tests bound it).
The rest of the model (attention, dense MLPs, the routers, embeddings, the head) is dequantized at load.

Measured on an H200 (BENCHMARKS.md, issue 19, "FP8 experts"): Qwen3-30B-A3B's decode steps at batch 64 and 256
are 1.34x and 1.13x faster than bf16's, a batch-1 step 2% slower, and an 8k-token prefill 1.2x slower (the tiles
convert every weight they multiply; the tiles are bf16's, not tuned for 8-bit weights).

W8A8 (PELLUCID_FP8_EXPERTS=w8a8): the experts also multiply float8 activations, as vLLM runs these checkpoints
(their `activation_scheme` is "dynamic"). Each token's input to a GEMM is quantized per group of the weight
block's K side (128): scale = the group's absolute maximum (at least 1e-10) / 448, code = value / scale in e4m3
(`quantize_activations`); the tensor cores multiply the two float8 operands and each K step's sum is scaled by
both scales. The results are then not the dequantized checkpoint's: the activations carry float8's 3-bit
mantissa (about 4% relative on one expert's output). The torch paths compute the same arithmetic, the
activations quantized and dequantized in float32 (`fake_quantized_activations`), so the CPU, the reference dtype
and the kernels agree up to summation order. On Hopper that order includes reduced precision: from 32 entries per
expert the kernels' tiles sum each K step's float8 products in the tensor cores' fast accumulator, as vLLM's and
DeepSeek-V3's block-FP8 GEMMs do, and an activation requantized after such a sum can land one float8 step from the
CPU's (1e-3 to 8e-3 relative per layer; BENCHMARKS.md, issue 19 round 18). Measured on an H200 (BENCHMARKS.md,
issue 19, "W8A8 experts"): Qwen3-30B-A3B-FP8's 8k-token prefill 177 against 200 ms, its batch-64 decode step 10.8
against 11.3 ms, batch 1 unchanged; one MoE layer 1.2-1.5x faster than W8A16 from 256 tokens on. It stays opt-in
because it changes the numbers the model computes.

The experts stay in FP8 when the checkpoint is block-wise FP8 in e4m3, its blocks tile every expert matrix
(moe_intermediate_size and hidden_size are multiples of both block sides), the layer's experts are not in the
config's `modules_to_not_convert`, and, under tensor parallelism, each rank's share of the intermediate size is
whole blocks too (each rank then holds its rows of the scales as of the codes). Otherwise they are dequantized at
load, as every other weight; the loader logs which. Setting
PELLUCID_FP8_EXPERTS=0 dequantizes them always (and any other value than 0, 1 and w8a8 is an error).
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from pellucid.distributed.parallel_state import Shard
from pellucid.models.quantized_checkpoint import dequantize_blockwise

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                     # the largest finite float8 e4m3fn value
SCALE_SUFFIX = "_scale_inv"         # a weight's block scales: the weight's name + this


def _quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The config's quantization_config as a dict (transformers may hold it as an object), or None."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None or isinstance(quantization, dict):
        return quantization
    return quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)


def fp8_expert_block(hf_config: Any, layer_idx: int, hidden_size: int, intermediate_size: int,
                     shard: Shard | None) -> tuple[int, int] | None:
    """The [bn, bk] block of layer `layer_idx`'s FP8 experts when they stay in FP8 (module docstring), else None.
    `shard`: this rank's part of the intermediate size under tensor parallelism."""
    quantization = _quantization_config(hf_config)
    if quantization is None or fp8_experts_mode() == "0":
        return None
    block = quantization.get("weight_block_size")
    if (quantization.get("quant_method") != "fp8" or quantization.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, (list, tuple)) or len(block) != 2):
        return None
    bn, bk = int(block[0]), int(block[1])
    # Even shards start at multiples of their length, so a length of whole blocks keeps every rank's on blocks.
    local = intermediate_size if shard is None else shard.length
    if any(size % side for size in (hidden_size, intermediate_size, local) for side in (bn, bk)):
        return None
    experts = f"model.layers.{layer_idx}.mlp.experts"
    for skipped in quantization.get("modules_to_not_convert") or ():
        if skipped and (skipped in experts or experts in skipped):
            return None
    return bn, bk


FP8_EXPERTS_MODES = ("0", "1", "w8a8")


def fp8_experts_mode() -> str:
    """PELLUCID_FP8_EXPERTS: "0" dequantizes at load, "1" (the default) keeps FP8 weights, "w8a8" also quantizes
    the activations (module docstring)."""
    mode = os.environ.get("PELLUCID_FP8_EXPERTS", "1").strip().lower()
    if mode not in FP8_EXPERTS_MODES:
        raise ValueError(f"PELLUCID_FP8_EXPERTS must be one of {', '.join(FP8_EXPERTS_MODES)}, got {mode!r}")
    return mode


def fp8_expert_activations(hf_config: Any) -> bool:
    """Whether FP8 experts multiply float8 activations (W8A8): PELLUCID_FP8_EXPERTS=w8a8, for a checkpoint whose
    activations are quantized as it runs (`activation_scheme` "dynamic", as the official Qwen3-*-FP8 declare)."""
    if fp8_experts_mode() != "w8a8":
        return False
    scheme = (_quantization_config(hf_config) or {}).get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"PELLUCID_FP8_EXPERTS=w8a8 quantizes activations as the model runs; this checkpoint's "
                         f"activation_scheme is {scheme!r}, whose stored activation scales are not supported")
    return True


def scale_shard(shard: Shard, side: int) -> Shard:
    """A rank's part of a weight dimension (`shard`, in elements) counted in scale blocks of `side` elements."""
    return Shard(tuple(start // side for start in shard.starts), shard.length // side, shard.total // side,
                 shard.rank)


def scale_grid(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of a weight's block scales: [..., ceil(N / bn), ceil(K / bk)]."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., N, K] * scale [..., N / bn, K / bk] in float32, rounded to dtype: the load-time dequantizer's
    values (the block sides follow from the shapes)."""
    return dequantize_blockwise(codes, scale, None, "an FP8 expert weight").to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 codes, float32 scales) of weight [..., N, K] with N, K multiples of the block: each block's
    scale is its absolute maximum over 448, as FP8 checkpoints are made (benchmark shapes draw theirs so)."""
    *lead, rows, cols = weight.shape
    bn, bk = block
    blocks = weight.float().reshape(*lead, rows // bn, bn, cols // bk, bk)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    codes = (blocks / scale.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.reshape(weight.shape), scale


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 codes, float32 scales [..., K / group]) of activations x [..., K]: each row's groups of `group`
    consecutive values scaled by their absolute maximum (at least 1e-10) over 448, as block-wise FP8 models
    quantize their activations as they run (activation_scheme "dynamic")."""
    *lead, k = x.shape
    groups = x.float().reshape(*lead, k // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    codes = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.reshape(x.shape), scale


def fake_quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x's values after quantize_activations, in float32: codes * their group's scale."""
    codes, scale = quantize_activations(x, group)
    return (codes.float().reshape(*scale.shape, group) * scale.unsqueeze(-1)).reshape(x.shape)
