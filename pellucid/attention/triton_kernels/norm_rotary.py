"""Qwen3's q/k RMSNorm + rotary for whole heads held by an attention program (the fused decode path).

The same arithmetic and roundings as pellucid.kernels.qk_norm_rotary (HF RMSNorm: the normed row rounded to
the activation dtype, times the weight, rounded again; then the neox / rotate_half rotation with cos/sin and
each product rounded to the activation dtype), on [rows, BLOCK_D] tiles of whole heads: each element's
rotate_half partner (d + D/2 or d - D/2) is loaded alongside it, so no tile is split or reassembled.
"""
from __future__ import annotations

import triton
import triton.language as tl

from pellucid.kernels.rotary import token_cos_sin


@triton.jit
def rotary_factors(cos_sin_ptr, stride_cs_kind, stride_cs_pos, positions_ptr, token, offs_d, d_mask,
                   HEAD_DIM: tl.constexpr, x_ptr):
    """(rotate_half partner index of each d [BLOCK_D], cos and sin [1, BLOCK_D] at the token's position as
    rotary.token_cos_sin gives them)."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    cos, sin = token_cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs_kind, stride_cs_pos, offs_d, d_mask, x_ptr)
    return partner, cos, sin


@triton.jit
def norm_rotate(x, x_partner, offs_d, weight, weight_partner, eps, cos, sin, HEAD_DIM: tl.constexpr):
    """rotary(rms_norm(x)) of loaded heads x [R, BLOCK_D], given each element's rotate_half partner x_partner
    [R, BLOCK_D], in x's dtype. The caller loads both, so it can issue every load before any arithmetic."""
    dtype = x.dtype
    x = x.to(tl.float32)
    x_partner = x_partner.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    normed = (weight[None, :] * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    normed_partner = (weight_partner[None, :] * (x_partner * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)[None, :]
    out = (normed * cos).to(dtype).to(tl.float32) + (sign * normed_partner * sin).to(dtype).to(tl.float32)
    return out.to(dtype)
