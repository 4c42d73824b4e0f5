"""silu(gate) * up in one pass, rounded as the torch code rounds (silu to the input dtype, then the product)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, num_cols, stride_gate, stride_up, stride_out,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] (same shape and dtype) -> silu(gate) * up [..., I]."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() < 1:
        raise ValueError(f"silu_and_mul needs two [..., I] tensors of one shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if gate.dim() != 2:       # batched callers (Qwen3-Omni's code predictor runs [B, S, H]): rows are rows
        return silu_and_mul(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])).view(gate.shape)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    num_rows, num_cols = gate.shape
    if num_rows > 0:
        block = min(triton.next_power_of_2(num_cols), 2048)
        grid = (num_rows, triton.cdiv(num_cols, block))
        _silu_and_mul_kernel[grid](gate, up, out, num_cols, gate.stride(0), up.stride(0), out.stride(0),
                                   BLOCK=block, num_warps=4, **pdl_launch_options(gate))
    return out
