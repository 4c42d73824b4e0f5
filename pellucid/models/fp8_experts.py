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

The experts stay in FP8 when the checkpoint is block-wise FP8 in e4m3, its blocks tile every expert matrix
(moe_intermediate_size and hidden_size are multiples of both block sides), the layer's experts are not in the
config's `modules_to_not_convert`, and, under tensor parallelism, each rank's share of the intermediate size is
whole blocks too (each rank then holds its rows of the scales as of the codes). Otherwise they are dequantized at
load, as every other weight; the loader logs which. Setting
PELLUCID_FP8_EXPERTS=0 dequantizes them always.
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


def fp8_expert_block(hf_config: Any, layer_idx: int, hidden_size: int, intermediate_size: int,
                     shard: Shard | None) -> tuple[int, int] | None:
    """The [bn, bk] block of layer `layer_idx`'s FP8 experts when they stay in FP8 (module docstring), else None.
    `shard`: this rank's part of the intermediate size under tensor parallelism."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None or os.environ.get("PELLUCID_FP8_EXPERTS", "1") == "0":
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)
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
