"""RMSNorm in one pass over each row, with HuggingFace's rounding order.

HF computes `weight * (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype)`: the normalised row is rounded
to the input dtype before the weight multiply, whose result has the promoted dtype. Doing each step
in float32 and rounding at the same points gives the same bits as the torch code for bf16/fp16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, num_cols, eps,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> [..., hidden] in torch.result_type(weight, x)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), hidden, eps,
                                           BLOCK=block, num_warps=min(max(block // 256, 1), 16),
                                           **pdl_launch_options(x))
    return out.view(x.shape)
