"""Residual add and RMSNorm in one pass: `residual + x` and its HF RMSNorm, from one read of each row.

The sum is rounded to the activation dtype (as torch's add rounds it) before it is normalised, and the
norm rounds where pellucid.kernels.rms_norm does, so both outputs equal the unfused torch code's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, out_ptr,
                         stride_x, stride_residual, stride_residual_out, stride_out, num_cols, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + residual).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_residual_out + cols, total, mask=mask)
    total = total.to(tl.float32)
    variance = tl.sum(total * total, axis=0) / num_cols
    normed = (total * tl.rsqrt(variance + eps)).to(residual_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] (one dtype), weight [hidden] -> (residual + x, rms_norm(residual + x)).

    Both outputs are fresh tensors; the inputs are left as they are (the residual may be a traced value).
    """
    if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm needs x and residual of one [T, hidden] shape and dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        x, residual = x.contiguous(), residual.contiguous()
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, residual_out, out, x.stride(0), residual.stride(0),
                                            residual_out.stride(0), out.stride(0), hidden, eps,
                                            BLOCK=block, num_warps=min(max(block // 256, 1), 16),
                                            **pdl_launch_options(x))
    return residual_out, out
