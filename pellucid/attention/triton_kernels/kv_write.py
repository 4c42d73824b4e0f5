"""Store the new tokens' keys and values into the paged KV cache, skipping padded rows (slot -1); an FP8 cache
gets them scaled and rounded as pellucid.attention.kv_dtype.quantize_kv does."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, is_fp8
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def fp8_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, LARGEST: tl.constexpr):
    """x as float32 on the grid of an FP8 type (MANTISSA bits, smallest normal 2^MIN_EXP, largest finite LARGEST):
    saturated, rounded to nearest with ties to even. Done in integer arithmetic, so the store's conversion only
    re-encodes exact values: the same bytes wherever it runs (the Triton interpreter's own float-to-FP8 conversion
    rounds ties away from zero and loses carries into the exponent)."""
    x = tl.clamp(x.to(tl.float32), -LARGEST, LARGEST)
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    magnitude = bits & 0x7FFFFFFF
    exp = (magnitude >> 23) - 127
    # The normal range: the float32 mantissa rounded to MANTISSA bits (a carry moves into the exponent).
    drop: tl.constexpr = 23 - MANTISSA
    normal = ((magnitude + ((1 << (drop - 1)) - 1) + ((magnitude >> drop) & 1)) >> drop) << drop
    # Below it: a whole number of the smallest subnormal, 2^(MIN_EXP - MANTISSA).
    shift = tl.minimum(23 + MIN_EXP - MANTISSA - exp, 31)
    significand = (magnitude & 0x7FFFFF) | 0x800000
    whole = significand >> shift
    rest = significand - (whole << shift)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((whole & 1) == 1))
    subnormal = ((whole + up.to(tl.int32)).to(tl.float32) * (2.0 ** (MIN_EXP - MANTISSA))).to(tl.int32, bitcast=True)
    return (tl.where(exp >= MIN_EXP, normal, subnormal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_inv_scale, v_inv_scale,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_LARGEST: tl.constexpr, PDL: tl.constexpr,
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
    if FP8_LARGEST > 0:     # an FP8 cache (pellucid.attention.kv_dtype)
        k = fp8_grid(k.to(tl.float32) * k_inv_scale, FP8_MANTISSA, FP8_MIN_EXP, FP8_LARGEST)
        v = fp8_grid(v.to(tl.float32) * v_inv_scale, FP8_MANTISSA, FP8_MIN_EXP, FP8_LARGEST)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _fp8_grid_args(cache_dtype: torch.dtype) -> dict[str, float]:
    """fp8_grid's constants for a cache of `cache_dtype` (FP8_LARGEST 0: not FP8, stored as it is)."""
    if not is_fp8(cache_dtype):
        return {"FP8_MANTISSA": 0, "FP8_MIN_EXP": 0, "FP8_LARGEST": 0.0}
    info = torch.finfo(cache_dtype)
    return {"FP8_MANTISSA": -int(math.log2(info.eps)), "FP8_MIN_EXP": int(math.log2(info.tiny)),
            "FP8_LARGEST": info.max}


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: KvScales = UNIT_KV_SCALES) -> None:
    """key/value: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    slot_mapping: [>= T] (rows past T and rows with slot -1 are not written); `kv_scales`: an FP8 cache's."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} heads of {head_dim}")
    quantize = is_fp8(kv_cache.dtype)
    if value.dtype != key.dtype or (key.dtype != kv_cache.dtype and not quantize):
        raise ValueError(f"key/value dtypes {key.dtype}, {value.dtype} differ from the KV cache dtype {kv_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head dimension contiguous in key, value and kv_cache")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, 1.0 / kv_scales.k, 1.0 / kv_scales.v,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim),
        **_fp8_grid_args(kv_cache.dtype), **pdl_launch_options(key),
    )
