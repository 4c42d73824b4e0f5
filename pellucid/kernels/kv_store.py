"""Storing a token's keys and values into the paged KV cache from inside another kernel.

The rotary kernels (rotary.py, qk_norm_rotary.py) hold the rotated keys in registers; given a
`pellucid.attention.fused_kv_store.FusedKVStore` they also store them and the values at the token's slot,
the same stores as pellucid.attention.triton_kernels.kv_write, so the separate KV-write launch goes.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def token_slot(slot_mapping_ptr, token, STORE_KV: tl.constexpr):
    """The token's cache slot (step metadata, so loadable ahead of a PDL wait); -1 when not storing."""
    if STORE_KV:
        return tl.load(slot_mapping_ptr + token).to(tl.int64)
    return tl.full([], -1, tl.int64)


@triton.jit
def _token_kv_mask(slot, num_heads, offs_h, d_mask):
    # Heads past num_heads, and every head of a padding row (slot -1) or of a kernel that stores nothing
    # (slot -1 too), are masked (a vector mask: the Triton CPU interpreter rejects scalar terms in masks).
    return (offs_h[:, None] < tl.where(slot >= 0, num_heads, 0)) & d_mask[None, :]


@triton.jit
def load_token_values(value_ptr, stride_v_t, stride_v_h, slot, token, num_heads, offs_h, offs_d, d_mask,
                      HALF: tl.constexpr):
    """The token's values (v1 | v2: the two halves of head_dim, [BLOCK_H, BLOCK_D]) for store_token_kv; masked
    to nothing for slot -1. Callers load them together with the query and key, before storing anything: a
    load after a store to the same buffer waits for it (the compiler cannot tell them apart), and at one
    token each such wait is an L2 round trip on the step's critical path."""
    mask = _token_kv_mask(slot, num_heads, offs_h, d_mask)
    src = value_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    return tl.load(src, mask=mask), tl.load(src + HALF, mask=mask)


@triton.jit
def store_token_kv(k1, k2, v1, v2, cache_ptr, stride_cache_kv, stride_cache_block, stride_cache_slot,
                   stride_cache_head, slot, num_heads, offs_h, offs_d, d_mask, HALF: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """Store keys and values (k1 | k2 and v1 | v2: halves of head_dim, [BLOCK_H, BLOCK_D] in the cache dtype)
    at `slot`; nothing for slot -1 (CUDA-graph padding)."""
    safe_slot = tl.maximum(slot, 0)
    mask = _token_kv_mask(slot, num_heads, offs_h, d_mask)
    dst = (cache_ptr + (safe_slot // BLOCK_SIZE) * stride_cache_block + (safe_slot % BLOCK_SIZE) * stride_cache_slot
           + offs_h[:, None] * stride_cache_head + offs_d[None, :])
    tl.store(dst, k1, mask=mask)
    tl.store(dst + HALF, k2, mask=mask)
    tl.store(dst + stride_cache_kv, v1, mask=mask)
    tl.store(dst + stride_cache_kv + HALF, v2, mask=mask)


def kv_store_args(kv_store: Any | None, key: torch.Tensor) -> dict[str, Any]:
    """Kernel arguments for storing key [T, kv_heads, D] (once rotated) and kv_store.value at kv_store's slots;
    with kv_store None the kernel stores nothing (its cache arguments are placeholders)."""
    if kv_store is None:
        return {"value_ptr": key, "cache_ptr": key, "slot_mapping_ptr": key, "stride_v_t": 0, "stride_v_h": 0,
                "stride_cache_kv": 0, "stride_cache_block": 0, "stride_cache_slot": 0, "stride_cache_head": 0,
                "STORE_KV": False, "BLOCK_SIZE": 1}
    value, cache, slots = kv_store.value, kv_store.kv_cache, kv_store.slot_mapping
    if value.shape != key.shape or value.dtype != key.dtype or value.stride(-1) != 1:
        raise ValueError(f"the fused KV store needs value {tuple(key.shape)} {key.dtype} with the head dim "
                         f"contiguous, got {tuple(value.shape)} {value.dtype}")
    if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != key.shape[1:] or cache.dtype != key.dtype \
            or cache.stride(-1) != 1:
        raise ValueError(f"the fused KV store needs a [2, blocks, block_size, {key.shape[1]}, {key.shape[2]}] "
                         f"{key.dtype} cache, got {tuple(cache.shape)} {cache.dtype}")
    if slots.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} rows for {key.shape[0]} tokens")
    return {"value_ptr": value, "cache_ptr": cache, "slot_mapping_ptr": slots,
            "stride_v_t": value.stride(0), "stride_v_h": value.stride(1), "stride_cache_kv": cache.stride(0),
            "stride_cache_block": cache.stride(1), "stride_cache_slot": cache.stride(2),
            "stride_cache_head": cache.stride(3), "STORE_KV": True, "BLOCK_SIZE": cache.shape[2]}
