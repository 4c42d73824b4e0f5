"""y = x @ W^T (+ bias) for a weight kept as float8 codes with block scales (pellucid.models.fp8_linear).

W's codes [N, K] with float32 scales [N / bn, K / bk] (both sides whole blocks). Every kernel multiplies the
values the load-time dequantizer gives: code * its block's scale in float32, rounded once to x's dtype; products
sum in float32 and the output rounds once, as the dequantized model's GEMM does. Three kernels, by row count:
- `fp8_skinny_linear` (one row, decode): the skinny GEMM's tiles (pellucid.kernels.skinny_gemm.pick_config) on
  the CUDA cores. Each tile is held as [rows, K / group, group] so a K group shares one scale: the scales load as
  a small [rows, groups] tile instead of one load per weight. The first tile's codes (all of them for whole-K
  tiles) and scales load before the PDL wait; float8 halves the bytes the step reads for these weights;
- `fp8_tiled_linear` (2 to 127 rows): a tensor-core GEMM whose K steps lie in one scale column; each weight tile
  is dequantized in registers (as pellucid.kernels.moe_gemm does for FP8 experts). Triton's conversion of 8-bit
  operands keeps it well below the bandwidth the bytes allow (mostly 1.0-2.7x bf16's time; BENCHMARKS.md);
- `dequantize_weight` + cuBLAS (128 rows and more): the weight dequantized once into a scratch matrix, then cuBLAS's
  rate; the dequantization costs 1.5 bf16 reads of the weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pellucid.kernels.moe_gemm import _dequantized as _dequantized_rows, _dot
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel
from pellucid.kernels.skinny_gemm import SUPPORTED_DTYPES, SkinnyConfig, interpreting, pick_config

FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _tile_codes(w_rows, s_rows, k0, K, offs_g, offs_c, SCALE_BK: tl.constexpr, GROUP: tl.constexpr,
                EVEN_K: tl.constexpr):
    """(codes [rows, GROUPS, GROUP], their scales [rows, GROUPS], their columns [GROUPS, GROUP]) of the K tile at
    k0: each group of GROUP columns lies in one scale column, so the scales load as [rows, GROUPS]."""
    cols = k0 + offs_g[:, None] * GROUP + offs_c[None, :]
    group_start = k0 + offs_g * GROUP
    if EVEN_K:
        codes = tl.load(w_rows + cols[None, :, :])
        scale = tl.load(s_rows + (group_start // SCALE_BK)[None, :])
    else:
        codes = tl.load(w_rows + cols[None, :, :], mask=(cols < K)[None, :, :], other=0.0)
        scale = tl.load(s_rows + (group_start // SCALE_BK)[None, :], mask=(group_start < K)[None, :], other=0.0)
    return codes, scale, cols


@triton.jit
def _dequantized(codes, scale, dtype):
    """code * scale in float32, rounded once to dtype, as float32 (the load-time dequantizer's values)."""
    return (codes.to(tl.float32) * scale[:, :, None]).to(dtype).to(tl.float32)


@triton.jit
def _row_tile(x_ptr, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _fp8_skinny_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, N, K, stride_w, stride_s,
                       HAS_BIAS: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                       GROUP: tl.constexpr, GROUPS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    """Program n: BLOCK_N output columns of one row x [K]; K tiles of GROUPS groups of GROUP columns."""
    release_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    offs_g = tl.arange(0, GROUPS)
    offs_c = tl.arange(0, GROUP)
    w_rows = w_ptr + safe_n[:, None, None] * stride_w
    s_rows = s_ptr + (safe_n // SCALE_BN)[:, None] * stride_s
    dtype = x_ptr.dtype.element_ty
    # The first tile's codes (the whole of K for whole-K tiles) and scales are weights: loaded ahead of the wait,
    # and held as 8-bit codes there, a quarter of the registers float32 values take (converting them before the
    # wait measured the same in the engine: BENCHMARKS.md, "FP8 projections").
    codes, scale, cols = _tile_codes(w_rows, s_rows, 0, K, offs_g, offs_c, SCALE_BK, GROUP, EVEN_K)
    wait_for_previous_kernel(PDL)
    w = _dequantized(codes, scale, dtype)
    acc = tl.sum(tl.sum(w * _row_tile(x_ptr, cols, K, EVEN_K)[None, :, :], axis=2), axis=1)
    for k0 in range(GROUP * GROUPS, K, GROUP * GROUPS):
        codes, scale, cols = _tile_codes(w_rows, s_rows, k0, K, offs_g, offs_c, SCALE_BK, GROUP, EVEN_K)
        w = _dequantized(codes, scale, dtype)
        acc += tl.sum(tl.sum(w * _row_tile(x_ptr, cols, K, EVEN_K)[None, :, :], axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_tiled_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_ym,
                      HAS_BIAS: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (m, n): a [BLOCK_M, BLOCK_N] output tile; each K step lies in one scale column (BLOCK_K divides
    SCALE_BK), so a weight row's step takes one scale."""
    release_dependents(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + safe_n[:, None] * stride_w
    s_rows = s_ptr + (safe_n // SCALE_BN) * stride_s
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wait_for_previous_kernel(PDL)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_rows + offs_k[None, :])
        acc = _dot(a, _dequantized_rows(w, s_rows, k0, dtype, SCALE_BK, True), acc, UPCAST_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, stride_w, stride_s, stride_o, SCALE_BN: tl.constexpr,
                       SCALE_BK: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, PDL: tl.constexpr):
    """Program (n, k): one [TILE_N, TILE_K] tile inside one scale block, code * scale rounded to out's dtype."""
    release_dependents(PDL)
    n0 = tl.program_id(0) * TILE_N
    k0 = tl.program_id(1) * TILE_K
    rows = (n0 + tl.arange(0, TILE_N)).to(tl.int64)
    cols = k0 + tl.arange(0, TILE_K)
    codes = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :])
    scale = tl.load(s_ptr + (n0 // SCALE_BN) * stride_s + k0 // SCALE_BK)
    wait_for_previous_kernel(PDL)      # nothing is written before the wait (pdl.py)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (codes.to(tl.float32) * scale).to(
        out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class TiledFp8Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Rows from which the weight is dequantized once and cuBLAS runs the product. Measured on an H200
# (benchmarks/fp8_linear_bench.py, 2026-11-30): at 64 rows the tiled kernel takes 20.7 us on Qwen3-30B-A3B's q/k/v
# [5120 x 2048] against 15.4 for dequantize + cuBLAS, but 81 against 166 on Llama-3.1-8B's gate/up [28672 x 4096],
# whose dequantization writes 235 MB; from 128 rows dequantize + cuBLAS is as fast or faster (q/k/v 15.6 against
# 29.4, gate/up 170 against 146, then 193 against 231 at 256 rows).
DEQUANTIZE_MIN_ROWS = 128


def _largest_power_of_two_dividing(n: int, cap: int) -> int:
    return min(n & -n, cap)


def block_of(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(bn, bk) of a weight whose scale grid tiles it in whole blocks."""
    return weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]


def check_operands(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or scale.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"FP8 linear needs x [M, K], codes [N, K] and scales [N / bn, K / bk]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(scale.shape)}")
    if weight.dtype != FP8_DTYPE or scale.dtype != torch.float32 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"FP8 linear needs float8 e4m3 codes, float32 scales and x in {SUPPORTED_DTYPES}; got "
                         f"{weight.dtype}, {scale.dtype}, {x.dtype}")
    if (weight.shape[0] % scale.shape[0] or weight.shape[1] % scale.shape[1] or not weight.is_contiguous()
            or not scale.is_contiguous() or x.stride(-1) != 1):
        raise ValueError(f"FP8 linear needs contiguous codes and scales whose blocks tile the weight, and x with "
                         f"unit stride along K; got codes {tuple(weight.shape)} and scales {tuple(scale.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not match codes {tuple(weight.shape)} and x "
                         f"{x.dtype}")


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ dequantized(weight)^T + bias -> [1, N] (the decode kernel)."""
    check_operands(x, weight, scale, bias)
    m, k = x.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"fp8_skinny_linear takes one row, got {m}")
    config = skinny_config(n, k)
    bn, bk = block_of(weight, scale)
    group = _largest_power_of_two_dividing(bk, config.block_k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, scale, bias if bias is not None else scale, y, n, k, weight.stride(0), scale.stride(0),
        HAS_BIAS=bias is not None, SCALE_BN=bn, SCALE_BK=bk, GROUP=group,
        GROUPS=config.block_k // group, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_options(x))
    return y


# The skinny kernel dequantizes a tile into float32 registers (bf16's kernel holds its tile as packed 16-bit values):
# at most this many per thread, or the whole-K tiles of the bf16 picks (256 weights a thread for Qwen3-30B-A3B's o
# projection) would spill.
SKINNY_MAX_FLOATS_PER_THREAD = 64
SKINNY_MAX_WARPS = 8


def skinny_config(n: int, k: int) -> SkinnyConfig:
    """The bf16 skinny GEMM's tile for one row (pick_config), with more warps, then shorter K tiles, where its
    float32 tile would exceed SKINNY_MAX_FLOATS_PER_THREAD."""
    config = pick_config(1, n, k)
    assert config is not None and not config.use_dot
    block_k, warps = config.block_k, config.num_warps
    while config.block_n * block_k > SKINNY_MAX_FLOATS_PER_THREAD * 32 * warps:
        if warps < SKINNY_MAX_WARPS:
            warps *= 2
        else:
            block_k //= 2
    return SkinnyConfig(1, config.block_n, block_k, warps, config.num_stages if block_k == config.block_k else 2,
                        False)


def pick_tiled_config(m: int, bk: int) -> TiledFp8Config:
    """The tensor-core tile for m rows; its K step divides the scale block's K side."""
    # The best tiles of a sweep (fp8_linear_bench.py --sweep, H200) were these at 2 and 16 rows; at 64 rows they
    # varied by shape (64 x 32 for q/k/v, 64 x 128 for gate/up, each ~30% faster than this middle one).
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64 if m > 32 else 32, 64, 128, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 64, 64, 4, 4
    return TiledFp8Config(block_m, block_n, _largest_power_of_two_dividing(bk, block_k), warps, stages)


def fp8_tiled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     config: TiledFp8Config | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(weight)^T + bias -> [M, N] on the tensor cores. `config` overrides the tile."""
    check_operands(x, weight, scale, bias)
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block_of(weight, scale)
    config = config or pick_tiled_config(m, bk)
    if bk % config.block_k:
        raise ValueError(f"the K step {config.block_k} must divide the scale block's K side {bk}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _fp8_tiled_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))](
            x, weight, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), weight.stride(0),
            scale.stride(0), y.stride(0), HAS_BIAS=bias is not None, SCALE_BN=bn, SCALE_BK=bk,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST_DOT=interpreting(),
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_options(x))
    return y


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in `dtype`: code * its block's scale in float32, rounded once (the load-time dequantizer's values)."""
    n, k = weight.shape
    bn, bk = block_of(weight, scale)
    tile_n, tile_k = _largest_power_of_two_dividing(bn, 32), _largest_power_of_two_dividing(bk, 128)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _dequantize_kernel[(n // tile_n, k // tile_k)](
        weight, scale, out, weight.stride(0), scale.stride(0), out.stride(0), SCALE_BN=bn, SCALE_BK=bk,
        TILE_N=tile_n, TILE_K=tile_k, num_warps=4, **pdl_launch_options(out))
    return out


def fp8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for x's row count (module docstring). Depends on shapes only, so CUDA graphs capture it."""
    m = x.shape[0]
    if m == 1:
        return fp8_skinny_linear(x, weight, scale, bias)
    if m < DEQUANTIZE_MIN_ROWS:
        return fp8_tiled_linear(x, weight, scale, bias)
    check_operands(x, weight, scale, bias)
    return torch.nn.functional.linear(x, dequantize_weight(weight, scale, x.dtype), bias)
