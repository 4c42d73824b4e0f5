"""Rotary embedding (neox / HF rotate_half layout) applied in place to query and key in one launch.

One program per token rotates all its query and key heads, reading cos/sin for the token's position
straight from the [2, max_positions, head_dim] float32 table. Rounding follows the torch code:
cos/sin are rounded to the activation dtype, each product is rounded, then the sum.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pellucid.kernels.kv_store import kv_store_args, load_token_values, store_token_kv, token_slot
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel

if TYPE_CHECKING:
    from pellucid.attention.fused_kv_store import FusedKVStore


@triton.jit
def token_cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs_kind, stride_cs_pos, offs_d, d_mask, x_ptr):
    """cos and sin [1, BLOCK_D] at the token's position, rounded to x's dtype (as the torch code rounds
    its cos/sin to the activation dtype) and held in float32."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs_pos + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + stride_cs_kind + pos * stride_cs_pos + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rotate_half_rounded(x1, x2, cos, sin, x_ptr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in float32, each product rounded to x's dtype."""
    dtype = x_ptr.dtype.element_ty
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-(x2 * sin)).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1, out2


@triton.jit
def _load_head_halves(x_ptr, stride_t, stride_h, token, num_heads, offs_h, offs_d, d_mask, HALF: tl.constexpr):
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    base = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    return base, mask, tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0)


@triton.jit
def load_token_qkv(q_ptr, k_ptr, value_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                   token, slot, num_q_heads, num_k_heads, offs_d, d_mask, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                   BLOCK_HK: tl.constexpr):
    """Everything a token's rotary step reads, loaded before it stores anything (kv_store.load_token_values
    says why): (q addresses, q mask, q1, q2, k addresses, k mask, k1, k2, v1, v2), x1 | x2 the two halves of
    head_dim of each head [BLOCK_H, BLOCK_D]; the values masked to nothing for slot -1."""
    q_base, q_mask, q1, q2 = _load_head_halves(q_ptr, stride_q_t, stride_q_h, token, num_q_heads,
                                               tl.arange(0, BLOCK_HQ), offs_d, d_mask, HALF)
    k_base, k_mask, k1, k2 = _load_head_halves(k_ptr, stride_k_t, stride_k_h, token, num_k_heads,
                                               tl.arange(0, BLOCK_HK), offs_d, d_mask, HALF)
    v1, v2 = load_token_values(value_ptr, stride_v_t, stride_v_h, slot, token, num_k_heads, tl.arange(0, BLOCK_HK),
                               offs_d, d_mask, HALF)
    return q_base, q_mask, q1, q2, k_base, k_mask, k1, k2, v1, v2


@triton.jit
def _rotate_store(base, mask, x1, x2, cos, sin, x_ptr, HALF: tl.constexpr):
    dtype = x1.dtype
    out1, out2 = rotate_half_rounded(x1.to(tl.float32), x2.to(tl.float32), cos, sin, x_ptr)
    out1, out2 = out1.to(dtype), out2.to(dtype)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_sin_ptr, positions_ptr,
                   stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs_kind, stride_cs_pos,
                   num_q_heads, num_k_heads,
                   value_ptr, cache_ptr, slot_mapping_ptr, stride_v_t, stride_v_h, stride_cache_kv,
                   stride_cache_block, stride_cache_slot, stride_cache_head,
                   HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    # Positions and slots are step metadata (copied in before the step's first kernel), so they and cos/sin
    # load ahead of the wait.
    cos, sin = token_cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs_kind, stride_cs_pos, offs_d, d_mask, q_ptr)
    slot = token_slot(slot_mapping_ptr, token, STORE_KV)
    wait_for_previous_kernel(PDL)
    q_base, q_mask, q1, q2, k_base, k_mask, k1, k2, v1, v2 = load_token_qkv(
        q_ptr, k_ptr, value_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, token, slot,
        num_q_heads, num_k_heads, offs_d, d_mask, HALF, BLOCK_HQ, BLOCK_HK)
    _rotate_store(q_base, q_mask, q1, q2, cos, sin, q_ptr, HALF)
    k1, k2 = _rotate_store(k_base, k_mask, k1, k2, cos, sin, k_ptr, HALF)
    if STORE_KV:
        store_token_kv(k1, k2, v1, v2, cache_ptr, stride_cache_kv, stride_cache_block, stride_cache_slot,
                       stride_cache_head, slot, num_k_heads, tl.arange(0, BLOCK_HK), offs_d, d_mask, HALF, BLOCK_SIZE)


def rotary_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_store: FusedKVStore | None = None) -> None:
    """Rotate query [T, heads, D] and key [T, kv_heads, D] in place at positions [T]; with `kv_store`, also
    store the rotated keys and its values in its cache at its slots (and mark it stored).

    cos_sin_cache: [2, max_positions, D] float32 (row 0 cos, row 1 sin; both halves equal).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not fit rotary")
    if query.dtype != key.dtype or query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary_inplace needs query and key of one dtype with the head dim contiguous")
    if cos_sin_cache.stride(-1) != 1 or positions.shape[0] < num_tokens:
        raise ValueError("rotary_inplace needs a contiguous cos/sin table and one position per token")
    if num_tokens == 0:
        if kv_store is not None:
            kv_store.stored = True      # nothing to store
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, cos_sin_cache, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), num_q_heads, key.shape[1],
        **kv_store_args(kv_store, key),
        HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
        num_warps=4, **pdl_launch_options(query))
    if kv_store is not None:
        kv_store.stored = True
