"""Residual add and RMSNorm in one pass: `residual + x` and its HF RMSNorm, from one read of each row.

The sum is rounded to the activation dtype (as torch's add rounds it) before it is normalised, and the
norm rounds where pellucid.kernels.rms_norm does, so both outputs equal the unfused torch code's.

`add_top_k_rms_norm` takes x as each token's top_k rows (a mixture of experts' weighted expert outputs,
pellucid.kernels.fused_moe.fused_expert_rows) and sums them first, as moe_gemm.sum_top_k does (float32, in
row order, rounded once to the activation dtype), so the MoE block's top-k sum needs no launch of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, out_ptr,
                         stride_x, stride_residual, stride_residual_out, stride_out, num_cols, eps,
                         TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    if TOP_K == 1:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            x += tl.load(x_ptr + (row * TOP_K + j) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + residual).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_residual_out + cols, total, mask=mask)
    total = total.to(tl.float32)
    variance = tl.sum(total * total, axis=0) / num_cols
    normed = (total * tl.rsqrt(variance + eps)).to(residual_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 like_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] (one dtype), weight [hidden] -> (residual + x, rms_norm(residual + x)).

    Both outputs are fresh tensors; the inputs are left as they are (the residual may be a traced value).
    `like_top_k`: x is a mixture of experts' summed rows; the norm's reduction then runs over as many warps as
    in add_top_k_rms_norm, whose results it must equal bit for bit (the order of a sum follows the warps).
    """
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm needs x and residual of one shape, got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    return _launch(x, 1, residual, weight, eps, like_top_k)


def add_top_k_rms_norm(rows: torch.Tensor, top_k: int, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [T * top_k, hidden] (token t's rows t * top_k ... t * top_k + top_k - 1), residual [T, hidden] ->
    (residual + x, rms_norm(residual + x)) where x[t] is the float32 sum of token t's rows, rounded to their dtype."""
    if top_k < 1 or rows.dim() != 2 or rows.shape != (residual.shape[0] * top_k, residual.shape[-1]):
        raise ValueError(f"add_top_k_rms_norm needs rows [T * {top_k}, hidden] for residual {tuple(residual.shape)}, "
                         f"got {tuple(rows.shape)}")
    return _launch(rows, top_k, residual, weight, eps)


def _launch(x: torch.Tensor, top_k: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            like_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm needs [T, hidden] activations of one dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and residual {tuple(residual.shape)} {residual.dtype}")
    hidden = residual.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        x, residual = x.contiguous(), residual.contiguous()
    residual_out = torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(residual.shape, dtype=torch.result_type(weight, x), device=x.device)
    if residual.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        # One program reads a token's top_k rows: twice the warps keeps more loads in flight (Qwen3-30B-A3B,
        # batch 1, 8 rows of 2048: 2.506 ms/step with 8 warps, 2.462 with 16, 2.508 with 4; H200).
        warps = min(max(block // 256, 1) * (2 if top_k > 1 or like_top_k else 1), 16)
        _add_rms_norm_kernel[(residual.shape[0],)](x, residual, weight, residual_out, out, x.stride(0),
                                                   residual.stride(0), residual_out.stride(0), out.stride(0), hidden,
                                                   eps, TOP_K=top_k, BLOCK=block, num_warps=warps,
                                                   **pdl_launch_options(x))
    return residual_out, out
