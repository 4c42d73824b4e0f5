"""Grouped GEMMs of the mixture-of-experts MLP over the token layout of moe_routing.py.

Program (block, column tile) multiplies the block's rows (token-expert entries, all of one expert) by that
expert's weights:
- `gate_up_silu`: x[token] @ gate_up[e]^T for the gate and the up rows of the tile, then silu(gate) * up,
  rounded where the torch code rounds (each product to the activation dtype, silu, the product), stored in
  the layout's row order (row block * BLOCK_M + i of a [blocks * BLOCK_M, I] buffer), so the next GEMM
  reads whole blocks of consecutive rows;
- `down_weighted`: those rows @ down[e]^T, rounded, times the entry's routing weight, rounded again
  (transformers multiplies the rounded expert output by the weight), stored at the entry's row of [entries, H];
- `sum_top_k`: each token's top-k rows summed in float32 (transformers adds them one by one in the
  activation dtype; the sum differs from it by that rounding only).

Expert weights may be float8 codes with block scales (pellucid.models.fp8_experts): each weight tile is then
dequantized in registers as it is loaded (code * scale in float32, rounded to the activations' dtype), which
gives the GEMM the load-time dequantized weights' values. In float32 the results are the dequantized weights'
bit for bit. In 16-bit dtypes they can differ in the last bits: Triton lays out a dot operand that comes from
8-bit loads with more K elements per thread (kWidth 4 against 2), so the tensor-core instructions take the K
products in other groups and the float32 sum runs in another order. (An opaque conversion that hides the 8-bit
origin restores the 16-bit layout and the bits, but measured 1.3-1.8x slower steps; scaling each K tile's partial
sum instead of the weights measured slower too: BENCHMARKS.md, issue 19.)

W8A8 (pellucid.models.fp8_experts, PELLUCID_FP8_EXPERTS=w8a8): `quantize_rows` turns a GEMM's input into float8
codes with one scale per row and 128 columns (the weight block's K side), bit for bit what the torch reference
computes; the GEMM's K step is then one such group, the tensor cores multiply the two float8 tiles (on Hopper they
add the step's products at reduced precision, as for every FP8 GEMM there), and each step's sum is scaled by its
row's and its columns' scales in float32. Quantizing inside each tile instead measured slower: every column tile
quantized the same rows again, and the correctly rounded division torch's reference takes is costly there.

Blocks past the routing's last one (block_expert -1) and rows past a block's count do nothing. Every
launch size depends on the token count only, so CUDA graphs capture them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pellucid.kernels.moe_routing import ExpertLayout
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel
from pellucid.kernels.skinny_gemm import interpreting


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _dot(a, b, acc, UPCAST_DOT: tl.constexpr):
    """acc += a @ b^T (b given as [N, K] rows)."""
    if a.dtype == tl.float32:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if UPCAST_DOT:      # the Triton CPU interpreter mishandles 16-bit dots; they are exact in fp32
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _dequantized(w, scale_rows, k0, dtype, SCALE_BK: tl.constexpr, FP8: tl.constexpr):
    """A weight tile as the GEMM multiplies it: for FP8 codes (pellucid.models.fp8_experts), each code times its
    block's scale in float32, rounded once to the activations' dtype; `scale_rows` [BLOCK_N] point at each row's
    scale row (the tile's K columns lie in one scale column)."""
    if FP8:
        scale = tl.load(scale_rows + k0 // SCALE_BK)
        w = (w.to(tl.float32) * scale[:, None]).to(dtype)
    return w


@triton.jit
def _rounded_to_e4m3(v):
    """v (float32, within +-448) rounded to the nearest float8 e4m3 value, ties to even, in float32. The
    Triton CPU interpreter's float8 conversion mis-rounds where the rounding carries into the exponent; the
    conversion of an already representable value is exact."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0     # multiples of 2^-9, e4m3's subnormal step, ties to even
    subnormal = tl.where(bits < 0, -magnitude, magnitude)     # the sign bit, so -0 stays -0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _codes(a, scale, UPCAST_DOT: tl.constexpr):
    """float8 e4m3 codes of a / scale (float32; the quotient correctly rounded, as torch divides)."""
    q = tl.clamp(tl.math.div_rn(a, scale), -448.0, 448.0)
    if UPCAST_DOT:
        q = _rounded_to_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, K, stride_x, stride_c, stride_s, GROUP: tl.constexpr,
                          GROUPS: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): GROUPS groups of GROUP columns of one row to float8 codes and their scales."""
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (group < K // GROUP)[:, None]
    wait_for_previous_kernel(PDL)
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), 1), 1e-10), 448.0)
    tl.store(codes_ptr + row * stride_c + cols, _codes(a, scale[:, None], UPCAST_DOT), mask=mask)
    tl.store(scales_ptr + row * stride_s + group, scale, mask=group < K // GROUP)


@triton.jit
def _scaled_fp8_dot(a, scale_a, w, w_scale_rows, k0, acc, SCALE_BK: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc += (a @ w^T) * scale_a[m] * scale_w[n]: float8 activation codes [BLOCK_M, BLOCK_K] times float8 weight
    codes [BLOCK_N, BLOCK_K] on the tensor cores (each product exact; the step's sum in their accumulator, at
    reduced precision on Hopper), then both scales in float32."""
    scale_w = tl.load(w_scale_rows + k0 // SCALE_BK)
    if UPCAST_DOT:
        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(w))
    return acc + part * scale_a[:, None] * scale_w[None, :]


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M: tl.constexpr):
    """(expert, entries [BLOCK_M], the block's rows in layout order, row mask) of this program's block;
    expert < 0 past the last block."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    rows = tl.load(block_rows_ptr + block)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < rows
    slots = block.to(tl.int64) * BLOCK_M + offs_m
    entries = tl.load(sorted_ptr + slots, mask=mask_m, other=0)
    return expert, entries, slots, mask_m


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, H, I,
                         stride_xt, stride_we, stride_wn, stride_ot, scale_ptr, stride_se, stride_sn,
                         a_scale_ptr, stride_as,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, FP8: tl.constexpr,
                         A8: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    wait_for_previous_kernel(PDL)
    expert, entries, slots, mask_m = _block_rows(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M)
    if expert >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        gate_rows = w_expert + safe_n[:, None] * stride_wn
        up_rows = w_expert + (safe_n + I)[:, None] * stride_wn
        s_expert = scale_ptr + expert.to(tl.int64) * stride_se
        gate_scales = s_expert + (safe_n // SCALE_BN) * stride_sn
        up_scales = s_expert + ((safe_n + I) // SCALE_BN) * stride_sn
        tokens = (entries // TOP_K).to(tl.int64)
        x_rows = x_ptr + tokens[:, None] * stride_xt
        a_scale_rows = a_scale_ptr + tokens * stride_as
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                wg = tl.load(gate_rows + offs_k[None, :])
                wu = tl.load(up_rows + offs_k[None, :])
            else:
                mask_k = offs_k < H
                a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wg = tl.load(gate_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
                wu = tl.load(up_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            if A8:
                a_scale = tl.load(a_scale_rows + k0 // SCALE_BK, mask=mask_m, other=0.0)
                acc_gate = _scaled_fp8_dot(a, a_scale, wg, gate_scales, k0, acc_gate, SCALE_BK, UPCAST_DOT)
                acc_up = _scaled_fp8_dot(a, a_scale, wu, up_scales, k0, acc_up, SCALE_BK, UPCAST_DOT)
            else:
                wg = _dequantized(wg, gate_scales, k0, a.dtype, SCALE_BK, FP8)
                wu = _dequantized(wu, up_scales, k0, a.dtype, SCALE_BK, FP8)
                acc_gate = _dot(a, wg, acc_gate, UPCAST_DOT)
                acc_up = _dot(a, wu, acc_up, UPCAST_DOT)
        act_dtype = out_ptr.dtype.element_ty
        gate = acc_gate.to(act_dtype).to(tl.float32)
        up = acc_up.to(act_dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_dtype).to(tl.float32)
        out = out_ptr + slots[:, None] * stride_ot + offs_n[None, :]
        tl.store(out, (act * up).to(act_dtype), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_weighted_kernel(h_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, H, I,
                          stride_ht, stride_we, stride_wn, stride_ot, scale_ptr, stride_se, stride_sn,
                          a_scale_ptr, stride_as,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, FP8: tl.constexpr, A8: tl.constexpr,
                          UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    wait_for_previous_kernel(PDL)
    expert, entries, slots, mask_m = _block_rows(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M)
    if expert >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + safe_n[:, None] * stride_wn
        w_scales = scale_ptr + expert.to(tl.int64) * stride_se + (safe_n // SCALE_BN) * stride_sn
        h_rows = h_ptr + slots[:, None] * stride_ht
        a_scale_rows = a_scale_ptr + slots * stride_as
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(h_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :])
            else:
                mask_k = offs_k < I
                a = tl.load(h_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            if A8:
                a_scale = tl.load(a_scale_rows + k0 // SCALE_BK, mask=mask_m, other=0.0)
                acc = _scaled_fp8_dot(a, a_scale, w, w_scales, k0, acc, SCALE_BK, UPCAST_DOT)
            else:
                acc = _dot(a, _dequantized(w, w_scales, k0, a.dtype, SCALE_BK, FP8), acc, UPCAST_DOT)
        act_dtype = out_ptr.dtype.element_ty
        routing = tl.load(weights_ptr + entries, mask=mask_m, other=0.0).to(tl.float32)
        y = acc.to(act_dtype).to(tl.float32) * routing[:, None]
        out = out_ptr + entries.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        tl.store(out, y.to(act_dtype), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_top_k_kernel(y_ptr, out_ptr, H, stride_yt, stride_ot, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                      PDL: tl.constexpr):
    release_dependents(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * stride_yt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask_h)


@dataclass(frozen=True)
class Fp8Rows:
    """Activations quantize_rows made: float8 e4m3 codes [rows, K] and float32 scales [rows, K / group]."""
    codes: torch.Tensor
    scales: torch.Tensor


def _launch_grouped(kernel, layout: ExpertLayout, n: int, k: int, tile: GemmTile, ref: torch.Tensor,
                    weight: torch.Tensor, scale: torch.Tensor | None, a_scales: torch.Tensor | None, *args,
                    **kwargs) -> None:
    """Launch a grouped GEMM over `weight` [E, N', K] (float8 codes with block scales `scale` [E, N' / bn, K / bk],
    or in the activations' dtype with scale None); `a_scales` [rows, K / bk]: the activations are float8 codes
    with these scales (W8A8, FP8 weights only)."""
    block_k = tile.block_k
    scale_args: dict[str, object] = {"scale_ptr": weight, "stride_se": 0, "stride_sn": 0, "SCALE_BN": 1,
                                     "SCALE_BK": 1, "FP8": False, "A8": False, "a_scale_ptr": weight,
                                     "stride_as": 0}
    if a_scales is not None and scale is None:
        raise ValueError("float8 activations need FP8 expert weights with their block scales")
    if scale is not None:
        scale_bn, scale_bk = weight.shape[1] // scale.shape[1], weight.shape[2] // scale.shape[2]
        if a_scales is not None:
            # The K tile is one activation group: the weight block's K side, as block-wise FP8 models run. The
            # tiles' pipelines are sized for K steps of at most 128: at 256 the long prefills' down tile would need
            # 256 KB of shared memory (tests/models/test_fp8_experts.py).
            if scale_bk & (scale_bk - 1) or not 16 <= scale_bk <= 128 or k // a_scales.shape[1] != scale_bk:
                raise ValueError(f"float8 activations need groups of the weight block's K side, a power of two in "
                                 f"16-128; got blocks of {scale_bk} and groups of {k // a_scales.shape[1]}")
            block_k = scale_bk
        else:
            # A K tile must lie in one scale column: the largest power of two dividing the block, up to the tile's.
            block_k = min(block_k, scale_bk & -scale_bk)
        scale_args = {"scale_ptr": scale, "stride_se": scale.stride(0), "stride_sn": scale.stride(1),
                      "SCALE_BN": scale_bn, "SCALE_BK": scale_bk, "FP8": True, "A8": a_scales is not None,
                      "a_scale_ptr": weight if a_scales is None else a_scales,
                      "stride_as": 0 if a_scales is None else a_scales.stride(0)}
    grid = (layout.num_blocks, triton.cdiv(n, tile.block_n))
    kernel[grid](*args, **scale_args, BLOCK_M=layout.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                 EVEN_K=k % block_k == 0, UPCAST_DOT=interpreting(), num_warps=tile.num_warps,
                 num_stages=tile.num_stages, **kwargs, **pdl_launch_options(ref))


def quantize_rows(x: torch.Tensor, group: int) -> Fp8Rows:
    """x [rows, K] quantized per row and group of `group` columns (pellucid.models.fp8_experts.quantize_activations,
    bit for bit)."""
    rows, k = x.shape
    if k % group or group & (group - 1):
        raise ValueError(f"quantize_rows needs a power-of-two group dividing the row, got {group} for {k}")
    codes = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, k // group), dtype=torch.float32, device=x.device)
    if rows:
        groups = min(triton.next_power_of_2(k // group), max(1, 2048 // group))
        _quantize_rows_kernel[(rows, triton.cdiv(k // group, groups))](
            x, codes, scales, k, x.stride(0), codes.stride(0), scales.stride(0), GROUP=group, GROUPS=groups,
            UPCAST_DOT=interpreting(), num_warps=4, **pdl_launch_options(x))
    return Fp8Rows(codes, scales)


def _operand(x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (x.codes, x.scales) if isinstance(x, Fp8Rows) else (x, None)


def gate_up_silu(x: torch.Tensor | Fp8Rows, gate_up: torch.Tensor, layout: ExpertLayout, tile: GemmTile,
                 gate_up_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[blocks * block_m, I] in layout row order: silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T) per entry;
    gate_up [E, 2I, H] (float8 codes when `gate_up_scale` holds their block scales; x may then be quantize_rows'
    codes: W8A8). `out_dtype`: the output's (x's by default; needed with codes)."""
    a, a_scales = _operand(x)
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    out = torch.empty((layout.sorted_entries.shape[0], inter), dtype=out_dtype or a.dtype, device=a.device)
    if layout.num_blocks:
        _launch_grouped(_gate_up_silu_kernel, layout, inter, hidden, tile, a, gate_up, gate_up_scale, a_scales,
                        a, gate_up, out, layout.sorted_entries, layout.block_expert, layout.block_rows, hidden,
                        inter, a.stride(0), gate_up.stride(0), gate_up.stride(1), out.stride(0), TOP_K=layout.top_k)
    return out


def down_weighted(h: torch.Tensor | Fp8Rows, down: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout,
                  tile: GemmTile, down_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """[entries, H]: weight[entry] * (h[row] @ down[e]^T), h in layout row order (gate_up_silu's output);
    down [E, H, I] (float8 codes when `down_scale` holds their block scales; h may then be quantize_rows' codes:
    W8A8), weights [T, k] (contiguous)."""
    a, a_scales = _operand(h)
    num_experts, hidden, inter = down.shape
    out = torch.empty((weights.numel(), hidden), dtype=out_dtype or a.dtype, device=a.device)
    if layout.num_blocks:
        _launch_grouped(_down_weighted_kernel, layout, hidden, inter, tile, a, down, down_scale, a_scales,
                        a, down, weights, out, layout.sorted_entries, layout.block_expert, layout.block_rows, hidden,
                        inter, a.stride(0), down.stride(0), down.stride(1), out.stride(0))
    return out


def sum_top_k(y: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, H]: the sum of each token's top_k consecutive rows of y [T * top_k, H], in float32."""
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=y.device)
    if num_tokens:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            y, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
            **pdl_launch_options(y))
    return out
