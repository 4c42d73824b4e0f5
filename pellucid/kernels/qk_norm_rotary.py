"""Qwen3's per-head query/key RMSNorm followed by rotary embedding, in place, in one launch.

One program per token normalises every query and key head over head_dim (HF RMSNorm rounding: the
normed row is rounded to the activation dtype, then scaled by the weight and rounded again), then
rotates it (neox / rotate_half layout) with the rounding of pellucid.kernels.rotary. Query and key may
be strided views into one fused qkv projection output; only the head dim must be contiguous.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pellucid.kernels.kv_store import kv_store_args, store_token_kv, token_slot
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel
from pellucid.kernels.rotary import load_token_qkv, rotate_half_rounded, token_cos_sin

if TYPE_CHECKING:
    from pellucid.attention.fused_kv_store import FusedKVStore


@triton.jit
def _norm_weights(weight_ptr, offs_d, d_mask, HALF: tl.constexpr):
    w1 = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return w1, w2


@triton.jit
def _norm_rotate_store(base, mask, x1, x2, w1, w2, eps, cos, sin, x_ptr, HALF: tl.constexpr):
    """RMSNorm each head of x1 | x2 (loaded by rotary.load_token_qkv), rotate, store at base; returns them."""
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    inv = tl.rsqrt(variance + eps)[:, None]
    n1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1, out2 = rotate_half_rounded(n1, n2, cos, sin, x_ptr)
    out1, out2 = out1.to(dtype), out2.to(dtype)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, positions_ptr,
                           stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs_kind, stride_cs_pos,
                           num_q_heads, num_k_heads, q_eps, k_eps,
                           value_ptr, cache_ptr, slot_mapping_ptr, stride_v_t, stride_v_h, stride_cache_kv,
                           stride_cache_block, stride_cache_slot, stride_cache_head,
                           HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                           BLOCK_HK: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           PDL: tl.constexpr):
    release_dependents(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    # Norm weights, positions and slots (step metadata, copied in before the step's first kernel) and
    # cos/sin load ahead of the wait: after it, only q, k and v, which the projection before this writes.
    cos, sin = token_cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs_kind, stride_cs_pos, offs_d, d_mask, q_ptr)
    q_w1, q_w2 = _norm_weights(q_weight_ptr, offs_d, d_mask, HALF)
    k_w1, k_w2 = _norm_weights(k_weight_ptr, offs_d, d_mask, HALF)
    slot = token_slot(slot_mapping_ptr, token, STORE_KV)
    wait_for_previous_kernel(PDL)
    q_base, q_mask, q1, q2, k_base, k_mask, k1, k2, v1, v2 = load_token_qkv(
        q_ptr, k_ptr, value_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, token, slot,
        num_q_heads, num_k_heads, offs_d, d_mask, HALF, BLOCK_HQ, BLOCK_HK)
    _norm_rotate_store(q_base, q_mask, q1, q2, q_w1, q_w2, q_eps, cos, sin, q_ptr, HALF)
    k1, k2 = _norm_rotate_store(k_base, k_mask, k1, k2, k_w1, k_w2, k_eps, cos, sin, k_ptr, HALF)
    if STORE_KV:
        store_token_kv(k1, k2, v1, v2, cache_ptr, stride_cache_kv, stride_cache_block, stride_cache_slot,
                       stride_cache_head, slot, num_k_heads, tl.arange(0, BLOCK_HK), offs_d, d_mask, HALF, BLOCK_SIZE)


def qk_norm_rotary_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
                           cos_sin_cache: torch.Tensor, kv_store: FusedKVStore | None = None) -> None:
    """query [T, heads, D], key [T, kv_heads, D]: rms_norm each head (weights [D]), then rotate, in place;
    with `kv_store`, also store the keys and its values in its cache at its slots (and mark it stored).

    cos_sin_cache: [2, max_positions, D] float32 (row 0 cos, row 1 sin; both halves equal).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    if key.dim() != 3 or key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not fit qk norm + rotary")
    if query.dtype != key.dtype or query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("qk_norm_rotary_inplace needs query and key of one dtype with the head dim contiguous")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,) or q_weight.dtype != query.dtype \
            or k_weight.dtype != query.dtype:
        raise ValueError(f"q/k norm weights must be [{head_dim}] in {query.dtype}, got {tuple(q_weight.shape)} "
                         f"{q_weight.dtype} and {tuple(k_weight.shape)} {k_weight.dtype}")
    if cos_sin_cache.stride(-1) != 1 or positions.shape[0] < num_tokens:
        raise ValueError("qk_norm_rotary_inplace needs a contiguous cos/sin table and one position per token")
    if num_tokens == 0:
        if kv_store is not None:
            kv_store.stored = True      # nothing to store
        return
    half = head_dim // 2
    _qk_norm_rotary_kernel[(num_tokens,)](
        query, key, q_weight, k_weight, cos_sin_cache, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), num_q_heads, key.shape[1], q_eps, k_eps,
        **kv_store_args(kv_store, key), HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
        num_warps=4, **pdl_launch_options(query))
    if kv_store is not None:
        kv_store.stored = True
