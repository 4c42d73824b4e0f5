"""Store the new tokens' keys and values into the paged KV cache, skipping padded rows (slot -1)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
    PDL: tl.constexpr,
):
    release_dependents(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)    # step metadata: loaded ahead of the wait
    # Every program waits, padding rows too: a kernel whose programs all left early could complete before
    # the kernel it follows, and the next kernel waits only for this one.
    wait_for_previous_kernel(PDL)
    if slot < 0:
        return  # CUDA-graph padding row: must not touch the cache
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    idx = tl.arange(0, BLOCK_HD)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    mask = idx < NUM_KV_HEADS * HEAD_DIM
    k = tl.load(key_ptr + token * stride_key_t + head * stride_key_h + dim, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + head * stride_value_h + dim, mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot + head * stride_cache_head + dim
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_cache_kv, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    slot_mapping: [>= T] (rows past T and rows with slot -1 are not written)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} heads of {head_dim}")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype} differs from the KV cache dtype {kv_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head dimension contiguous in key, value and kv_cache")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim), **pdl_launch_options(key),
    )
