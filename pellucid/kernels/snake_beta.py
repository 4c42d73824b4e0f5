"""SnakeBeta, code2wav's activation: x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel, in one pass.

The torch code is seven elementwise launches, five of them over the whole [B, C, L] signal (up to ~100k
samples x 96 channels a window), each reading and writing it; here one program reads a row piece once and
writes it once. Rounding follows the torch code step by step (exp(alpha), exp(beta), the reciprocal, the
product x * alpha, its sine, the square, the scaled square and the sum are each rounded to the activation
dtype), and exp and sin are libdevice's, the functions torch's own kernels call (numpy's under the Triton
interpreter, which has no libdevice).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel
from pellucid.kernels.skinny_gemm import interpreting

_BLOCK = 1024


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _sin(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.sin(x)
    return tl.sin(x)


@triton.jit
def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, channels, length, stride_xb, stride_xc,
                       BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0)                      # batch * channels + channel
    channel = row % channels
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    dtype = out_ptr.dtype.element_ty
    alpha = _round(_exp(tl.load(alpha_ptr + channel).to(tl.float32), LIBDEVICE), dtype)
    beta = _round(_exp(tl.load(beta_ptr + channel).to(tl.float32), LIBDEVICE), dtype)
    inverse = _round(1.0 / _round(beta + 1e-9, dtype), dtype)
    wait_for_previous_kernel(PDL)
    base = (row // channels).to(tl.int64) * stride_xb + channel.to(tl.int64) * stride_xc
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    wave = _round(_sin(_round(x * alpha, dtype), LIBDEVICE), dtype)
    out = _round(x + _round(inverse * _round(wave * wave, dtype), dtype), dtype)
    tl.store(out_ptr + row.to(tl.int64) * length + offs, out.to(dtype), mask=mask)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, L] (unit stride along L), alpha and beta [C] (the log-scale parameters) -> [B, C, L] contiguous."""
    if x.dim() != 3 or alpha.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise ValueError(f"snake_beta needs x [B, C, L] and alpha, beta [C], got {tuple(x.shape)}, "
                         f"{tuple(alpha.shape)}, {tuple(beta.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (batch * channels, triton.cdiv(length, _BLOCK))
        _snake_beta_kernel[grid](x, alpha, beta, out, channels, length, x.stride(0), x.stride(1), BLOCK=_BLOCK,
                                 LIBDEVICE=not interpreting(), num_warps=4, **pdl_launch_options(x))
    return out
