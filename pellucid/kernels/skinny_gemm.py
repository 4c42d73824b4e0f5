"""Skinny GEMMs for decode batches: y = x @ W^T with few rows in x, bound by reading W once.

x [M, K] (M small), W [N, K] row-major (the nn.Linear layout), optional bias [N]; fp32 accumulation and
one rounding to the output dtype, as cuBLAS does. Each program owns BLOCK_N output columns and streams
its W rows once over K, so the grid has many programs even at M = 1 (cuBLAS tiles N in blocks of 64 or
more and leaves most SMs idle on these shapes). Two inner products: broadcast multiply-and-sum on the
CUDA cores (any BLOCK_M, small BLOCK_N) and `tl.dot` on the tensor cores (BLOCK_M = 16).

`silu_mul_linear` fuses the gated MLP's activation into the load of the down projection's input:
silu(gate) * up is recomputed per K tile from the merged gate_up output, rounded where the torch code
rounds (silu to the activation dtype, then the product), and never written to memory.

Which M take this path and with which tile is a function of (M, N, K) alone (`pick_config`), so a
CUDA-graph capture at a given batch size always records the same kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool


@triton.jit
def _load_w_tile(w_rows, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + offs_k[None, :])
    return tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _load_x_tile(x_rows, offs_k, mask_m, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    if EVEN_K:
        x_mask = mask_m[:, None]
    else:
        x_mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
    if SILU_MUL:
        # x_rows point at the merged [gate | up] row: up sits K columns after gate.
        up = tl.load(x_rows + K + offs_k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        act_dtype = x.dtype
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_dtype).to(tl.float32)
        x = (act * up).to(act_dtype)
    return x


@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    if USE_DOT:
        if x.dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        elif UPCAST_DOT:    # the Triton CPU interpreter mishandles 16-bit dots; they are exact in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def dot_rows(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, K, stride_xm, stride_wn,
             SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 = x[offs_m] @ W[offs_n]^T, with the PDL wait inside: the first weight
    tile is loaded before waiting for the kernel that produces x (no kernel writes weights), so under
    PDL the weight stream starts while that kernel finishes. offs_n may be any rows of W."""
    # Clamp out-of-range W rows to row 0 instead of masking them: every W load stays unmasked along N,
    # and the caller drops those columns at its store.
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    w_rows = w_ptr + safe_n[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    w = _load_w_tile(w_rows, offs_k, K, EVEN_K)
    wait_for_previous_kernel(PDL)
    x = _load_x_tile(x_rows, offs_k, mask_m, K, EVEN_K, SILU_MUL)
    acc = _accumulate(acc, x, w, USE_DOT, UPCAST_DOT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _load_w_tile(w_rows, offs_k, K, EVEN_K)
        x = _load_x_tile(x_rows, offs_k, mask_m, K, EVEN_K, SILU_MUL)
        acc = _accumulate(acc, x, w, USE_DOT, UPCAST_DOT)
    return acc


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = dot_rows(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, K, stride_xm, stride_wn, SILU_MUL, EVEN_K,
                   BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, UPCAST_DOT, PDL)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.where(mask_n, offs_n, 0)).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Largest M that takes the skinny path. Measured on an H100 (benchmarks/skinny_gemm_bench.py, CUDA-graph
# replays, bf16, Qwen3-0.6B / Llama-3.2-1B / Llama-3.1-8B projections): at M = 1 the skinny GEMM beats
# cuBLAS by 1-32% (o and down most); at M = 2 it wins only where N <= K (o, down: up to 25%) and loses up
# to 5% on q/k/v and gate/up; from M = 4 on the best of a tile sweep is within +-5% of cuBLAS.
MAX_ROWS = 2
# The fused silu-and-mul prologue re-reads its [M, 2K] input in every program. Fused against the unfused
# pair (silu_and_mul + the better GEMM): M = 1 with 8-row tiles 7.1 vs 7.7 us (K = 3072), 18.1 vs 18.6
# (K = 8192), 43.9 vs 43.5 (K = 14336); M = 2 with 4-row tiles 8.0 vs 8.3 (K = 3072), 21.2 vs 18.6 (K = 8192).
SILU_MUL_MAX_K = {1: 8192, 2: 4096}
# Whole-K tiles at M = 1: each program loads its entire [BLOCK_N, K] weight slice (64 weights per
# thread) before the PDL wait, so no weight load is left behind it and, with every program resident,
# the whole matrix streams in while the kernel before it finishes. Measured on an H100 (2026-11-23,
# benchmarks/skinny_chain_bench.py, bf16, layers in a CUDA graph): Qwen3-0.6B 21.40 -> 17.48 us/layer,
# Llama-3.2-1B 64.6 -> 58.7 with K <= 3072 and 58.3 -> 52.0 more with its K = 8192 fused SiLU down
# projection; engine batch-1 decode of Qwen3-0.6B 0.989 -> 0.888 ms/step. Llama-3.1-8B (K = 4096, N up
# to 28672: many waves of programs) got slower with them, 6.04 -> 6.20 ms/step, so larger K keep the
# pipelined K loop. PELLUCID_SKINNY_PRELOAD=0 turns whole-K tiles off (to measure them).
# Up to K = 4096, matrices of at most 8 Mi weights (16 MiB in bf16, half the register file of a 132-SM
# Hopper: every program resident at once) also take whole-K tiles, at 256 weights per thread (4 rows, 2
# warps). Qwen3-30B-A3B's o projection [2048 x 4096] is one: the q/k norm, attention and its reduce before
# it leave the memory bus idle for ~10 us, and its deep K tiles loaded only their first half there.
# Measured on an H200 (2026-11-28, engine batch-1 decode, bf16; BENCHMARKS.md, issue 19, round 6):
# Qwen3-30B-A3B 2.92 ms/step with the deep tiles; whole-K at 64 weights per thread 2.94, at 128 2.68, at
# 256 2.58. Llama-3.1-8B's o [4096 x 4096] is past the bound: whole-K there measured no gain. (Counted in
# weights: float32 weights take twice the registers and may spill; float32 decode is for checks.)
# Whole-K tiles of a larger matrix (Qwen3-30B-A3B's q/k/v [5120 x 2048] needs 62% of the register file) cannot
# all be resident beside the kernels before them, yet they stay register tiles: staging the weights in shared
# memory instead (every K tile's cp.async issued by the pipeliner ahead of the wait) measured slower for every
# tile tried, q/k/v and o alike (H200, 2026-11-28, BENCHMARKS.md, issue 19, round 10).
PRELOAD_MAX_K = 3072
PRELOAD_WIDE_MAX_K = 4096
PRELOAD_WIDE_MAX_ELEMENTS = 8 * 2 ** 20
PRELOAD_WIDE_ELEMENTS_PER_THREAD = 256
PRELOAD_SILU_MAX_K = 8192          # the fused SiLU down projection, when its N is at most:
PRELOAD_SILU_MAX_N = 2048
PRELOAD_ELEMENTS_PER_THREAD = 64
# Past whole-K sizes, M = 1 products with N <= K (Llama-3.1-8B's o and down projections) take 2048-wide K
# tiles at 32 weights per thread: 4 rows, 8 warps, 3 stages from K = 8192, else 2 rows, 4 warps, 2 stages.
# Measured in the engine (H100, 2026-11-23, Llama-3.1-8B batch 1, one call, ms/step): down [4096 x 14336]
# 5.870 (4 rows x 1024, 4 warps) -> 5.697; o [4096 x 4096] 5.870 -> 5.803. Shallower 512-wide tiles
# were far slower (6.556), 8-row tiles slower (5.963); q/k/v, gate/up and the head keep 1024-wide tiles.
DEEP_BLOCK_K = 2048
DEEP_K_LONG = 8192


def _preloads(m: int, n: int, k: int, silu_mul: bool) -> bool:
    if m != 1 or os.environ.get("PELLUCID_SKINNY_PRELOAD", "1") == "0":
        return False
    return (k <= PRELOAD_MAX_K or _preloads_wide(n, k, silu_mul)
            or (silu_mul and k <= PRELOAD_SILU_MAX_K and n <= PRELOAD_SILU_MAX_N))


def _preloads_wide(n: int, k: int, silu_mul: bool) -> bool:
    return not silu_mul and PRELOAD_MAX_K < k <= PRELOAD_WIDE_MAX_K and n * k <= PRELOAD_WIDE_MAX_ELEMENTS


def pick_config(m: int, n: int, k: int, silu_mul: bool = False) -> SkinnyConfig | None:
    """The tile for an [m, k] x [n, k]^T product, or None when cuBLAS (and the unfused activation) should run it."""
    if m < 1 or m > MAX_ROWS or (m == 2 and n > k) or (silu_mul and k > SILU_MUL_MAX_K[m]):
        return None
    if _preloads(m, n, k, silu_mul):
        block_k = triton.next_power_of_2(k)
        block_n = 8 if k <= 1024 else 4 if k <= 4096 else 2
        wide = _preloads_wide(n, k, silu_mul)
        per_thread = PRELOAD_WIDE_ELEMENTS_PER_THREAD if wide else PRELOAD_ELEMENTS_PER_THREAD
        return SkinnyConfig(block_m=1, block_n=block_n, block_k=block_k,
                            num_warps=max(1, block_n * block_k // (per_thread * 32)),
                            num_stages=1, use_dot=False)
    if m == 1 and k > PRELOAD_MAX_K and n <= k and not silu_mul:
        # Deep K tiles (32 weights per thread) where a long K loop streams few output rows per program.
        long_k = k >= DEEP_K_LONG
        block_n = 4 if long_k else 2
        return SkinnyConfig(block_m=1, block_n=block_n, block_k=DEEP_BLOCK_K, num_warps=block_n * DEEP_BLOCK_K // 1024,
                            num_stages=3 if long_k else 2, use_dot=False)
    block_k = min(1024, triton.next_power_of_2(k))
    if m == 1 or n <= 2048:
        # CUDA cores, 4 (or 8) weight rows per program: 256+ programs at N = 1024, each streaming 8 KB per step.
        block_n = 8 if n >= 16384 or (silu_mul and m == 1) else 4
        return SkinnyConfig(block_m=triton.next_power_of_2(m), block_n=block_n, block_k=block_k,
                            num_warps=4, num_stages=3, use_dot=False)
    return SkinnyConfig(block_m=16, block_n=32, block_k=min(256, block_k), num_warps=4, num_stages=4, use_dot=True)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"skinny GEMM needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny GEMM needs one dtype of {SUPPORTED_DTYPES} for x, weight and bias, got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if x.stride(-1) != 1 or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("skinny GEMM needs x with unit stride along K and contiguous weight and bias")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, silu_mul: bool,
            config: SkinnyConfig | None) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    config = config or pick_config(m, n, k, silu_mul)
    if config is None:
        raise ValueError(f"no skinny GEMM tile for M={m}, N={n}, K={k} (cuBLAS is faster there)")
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        UPCAST_DOT=interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_options(x))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias -> [M, N] in x's dtype. `config` overrides `pick_config` (benchmarks)."""
    check_operands(x, weight, bias, x.shape[-1] if x.dim() == 2 else -1)
    return _launch(x, weight, bias, x.shape[1], False, config)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: SkinnyConfig | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T + bias, where gate_up [M, 2I] = [gate | up] and weight is [N, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul_linear needs gate_up [M, 2I], got {tuple(gate_up.shape)}")
    intermediate = gate_up.shape[1] // 2
    check_operands(gate_up, weight, bias, intermediate)
    return _launch(gate_up, weight, bias, intermediate, True, config)
