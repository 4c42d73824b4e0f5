"""Skinny decode GEMMs whose programs own pairs of weight rows, so the epilogue combines each pair before
anything is written to memory.

- `qkv_rotary_linear`: the merged q/k/v projection with rotary applied to q and k (rows d and d + D/2 of
  a head pair up, the neox / HF rotate_half layout), and with a KV cache given, the rotated keys and the
  values stored at their slots. One launch instead of projection + rotary (+ KV write).
- `gate_up_silu_linear`: the merged gate/up projection reduced to silu(gate) * up (gate row j pairs with
  up row j), [M, I] instead of [M, 2I]. One launch instead of projection + SiLU-and-mul, where the down
  projection cannot take the activation into its own prologue (skinny_gemm.silu_mul_linear).

Under PDL each of those small kernels cost a step its own dependent launch (decode_timeline,
Llama-3.1-8B batch 1: rotary 52 us and SiLU-and-mul 47 us per step); the epilogue costs a few flops
on values already in registers. The K loop is skinny_gemm's (`dot_rows`) with the tile
`skinny_gemm.pick_config` picks for the plain product, and the epilogues round where the unfused kernels
round (the product to the activation dtype first). Not bit for bit the unfused pair: with an epilogue
after it the compiler may lay the product out, and so sum it, differently.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents
from pellucid.kernels.rotary import rotate_half_rounded
from pellucid.kernels.skinny_gemm import SkinnyConfig, check_operands, dot_rows, interpreting, pick_config


@triton.jit
def _paired_accumulator(acc, bias_ptr, offs_n, y_ptr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        PAIRS: tl.constexpr):
    """The product rounded to the output dtype (as the unfused GEMM stores it), split into the pairs'
    first and second rows, each [BLOCK_M, PAIRS] in float32."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    rounded = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    return tl.split(tl.reshape(rounded, [BLOCK_M, PAIRS, 2]))


@triton.jit
def _qkv_rotary_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, cache_ptr,
                       M, K, stride_xm, stride_wn, stride_ym, stride_cs_kind, stride_cs_pos,
                       stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HAS_BIAS: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    ROTARY_COLS: tl.constexpr = (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # Programs below ROTARY_COLS / BLOCK_N own PAIRS rotary pairs each (q heads, then k heads); the rest
    # own BLOCK_N consecutive value rows.
    rotating = pid * BLOCK_N < ROTARY_COLS
    cols = tl.arange(0, BLOCK_N)
    pair_of_col = pid * PAIRS + cols // 2
    rotary_rows = (pair_of_col // HALF) * HEAD_DIM + pair_of_col % HALF + (cols % 2) * HALF
    offs_n = tl.where(rotating, rotary_rows, pid * BLOCK_N + cols)
    pairs = pid * PAIRS + tl.arange(0, PAIRS)
    head, dim = pairs // HALF, pairs % HALF
    # Positions, slots and cos/sin are step metadata or constants: loaded ahead of the PDL wait in dot_rows.
    pos = tl.load(positions_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[:, None] * stride_cs_pos + dim[None, :]
    cos = tl.load(cs).to(y_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(cs + stride_cs_kind).to(y_ptr.dtype.element_ty).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
    else:
        slot = tl.full([BLOCK_M], -1, tl.int64)
    safe_slot = tl.maximum(slot, 0)
    cache_rows = cache_ptr + (safe_slot // BLOCK_SIZE) * stride_cache_block + (safe_slot % BLOCK_SIZE) * stride_cache_slot
    stores_kv = mask_m & (slot >= 0)
    acc = dot_rows(x_ptr, w_ptr, offs_m, offs_n, mask_m, offs_n >= 0, K, stride_xm, stride_wn, False, EVEN_K,
                   BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, UPCAST_DOT, PDL)
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
    if rotating:
        x1, x2 = _paired_accumulator(acc, bias_ptr, offs_n, y_ptr, HAS_BIAS, BLOCK_M, PAIRS)
        out1, out2 = rotate_half_rounded(x1, x2, cos, sin, y_ptr)
        out1, out2 = out1.to(y_ptr.dtype.element_ty), out2.to(y_ptr.dtype.element_ty)
        first = (head * HEAD_DIM + dim)[None, :]
        tl.store(y_rows + first, out1, mask=mask_m[:, None])
        tl.store(y_rows + first + HALF, out2, mask=mask_m[:, None])
        if STORE_KV:
            is_key = head >= NUM_Q_HEADS
            key_dst = cache_rows[:, None] + ((head - NUM_Q_HEADS) * stride_cache_head + dim)[None, :]
            key_mask = stores_kv[:, None] & is_key[None, :]
            tl.store(key_dst, out1, mask=key_mask)
            tl.store(key_dst + HALF, out2, mask=key_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_rows + offs_n[None, :], out, mask=mask_m[:, None])
        if STORE_KV:
            value_col = offs_n - ROTARY_COLS
            value_dst = cache_rows[:, None] + stride_cache_kv + \
                ((value_col // HEAD_DIM) * stride_cache_head + value_col % HEAD_DIM)[None, :]
            tl.store(value_dst, out, mask=stores_kv[:, None])


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, K, INTERMEDIATE, stride_xm, stride_wn, stride_ym,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    PAIRS: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    cols = tl.arange(0, BLOCK_N)
    unit = pid * PAIRS + cols // 2
    offs_n = unit + (cols % 2) * INTERMEDIATE        # gate row j, then up row j
    mask_n = unit < INTERMEDIATE
    acc = dot_rows(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, K, stride_xm, stride_wn, False, EVEN_K,
                   BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, UPCAST_DOT, PDL)
    gate, up = _paired_accumulator(acc, bias_ptr, tl.where(mask_n, offs_n, 0), y_ptr, HAS_BIAS, BLOCK_M, PAIRS)
    act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
    units = pid * PAIRS + tl.arange(0, PAIRS)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + units[None, :],
             (act * up).to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (units < INTERMEDIATE)[None, :])


def paired_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The plain product's tile when its programs can own whole pairs (an even BLOCK_N), else None."""
    config = pick_config(m, n, k)
    return config if config is not None and config.block_n % 2 == 0 else None


def qkv_rotary_config(m: int, k: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> SkinnyConfig | None:
    """The tile for `qkv_rotary_linear`, or None when these shapes should take the unfused path: no skinny
    tile, or one whose programs would straddle the rotary and value rows."""
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    config = paired_config(m, n, k)
    if config is None or head_dim % 2 or ((num_q_heads + num_kv_heads) * head_dim) % config.block_n:
        return None
    return config


def qkv_rotary_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                      config: SkinnyConfig | None = None) -> torch.Tensor:
    """[q | k | v] = x @ weight^T + bias [M, N] with q and k rotated at `positions` [>= M]; with `kv_cache`
    [2, blocks, block_size, kv_heads, head_dim], the rotated keys and the values are also stored at
    `slot_mapping` [>= M] (slot -1: not stored). cos_sin_cache: [2, max_positions, head_dim] float32."""
    m, k = x.shape[0], x.shape[-1]
    check_operands(x, weight, bias, k)
    if weight.shape[0] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"q/k/v weight {tuple(weight.shape)} does not hold {num_q_heads} + 2 x {num_kv_heads} "
                         f"heads of {head_dim}")
    if positions.shape[0] < m or cos_sin_cache.stride(-1) != 1 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("qkv_rotary_linear needs one position per row and a [2, positions, head_dim] "
                         "cos/sin table, contiguous along head_dim")
    store_kv = kv_cache is not None
    if store_kv:
        if slot_mapping is None or slot_mapping.shape[0] < m:
            raise ValueError("storing K/V needs one slot per row")
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim) \
                or kv_cache.dtype != x.dtype or kv_cache.stride(-1) != 1:
            raise ValueError(f"the KV cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}] {x.dtype}, "
                             f"got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    config = config or qkv_rotary_config(m, k, num_q_heads, num_kv_heads, head_dim)
    if config is None or config.block_n % 2 or ((num_q_heads + num_kv_heads) * head_dim) % config.block_n:
        raise ValueError(f"no paired skinny tile for M={m}, K={k} with heads {num_q_heads}/{num_kv_heads}x{head_dim}")
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cache = kv_cache if store_kv else y
    _qkv_rotary_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))](
        x, weight, bias if bias is not None else weight, y, positions, cos_sin_cache,
        slot_mapping if store_kv else positions, cache,
        m, k, x.stride(0), weight.stride(0), y.stride(0), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        cache.stride(0) if store_kv else 0, cache.stride(1) if store_kv else 0,
        cache.stride(2) if store_kv else 0, cache.stride(3) if store_kv else 0,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_BIAS=bias is not None,
        STORE_KV=store_kv, BLOCK_SIZE=cache.shape[2] if store_kv else 1, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        UPCAST_DOT=interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_options(x))
    return y


def gate_up_silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        config: SkinnyConfig | None = None) -> torch.Tensor:
    """silu(gate) * up [M, I] where [gate | up] = x @ weight^T + bias, weight [2I, K] (gate rows, then up rows)."""
    m, k = x.shape[0], x.shape[-1]
    check_operands(x, weight, bias, k)
    if weight.shape[0] % 2:
        raise ValueError(f"gate/up weight needs an even row count, got {tuple(weight.shape)}")
    config = config or paired_config(m, weight.shape[0], k)
    if config is None or config.block_n % 2:
        raise ValueError(f"no paired skinny tile for M={m}, N={weight.shape[0]}, K={k}")
    intermediate = weight.shape[0] // 2
    y = torch.empty((m, intermediate), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _gate_up_silu_kernel[(triton.cdiv(intermediate, config.block_n // 2), triton.cdiv(m, config.block_m))](
        x, weight, bias if bias is not None else weight, y, m, k, intermediate, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot, UPCAST_DOT=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_options(x))
    return y
