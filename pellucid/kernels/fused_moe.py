"""The fused mixture-of-experts MLP on the GPU: routing, token layout, two grouped GEMMs and the top-k sum.

Per MoE layer (pellucid.models.moe calls these while `fused_kernels_enabled(x, "moe")`):
1. the router GEMM (the `gate` module, an ordinary linear layer);
2. `route_and_align`: softmax, top-k, renormalisation, then the entries grouped by expert in blocks of
   `block_m` rows (moe_routing.py, two launches);
3. `fused_experts`: the gate/up grouped GEMM with SiLU-and-mul, the down grouped GEMM weighted by the
   routing weights, and the sum over each token's experts (moe_gemm.py); the expert weights in the
   activations' dtype, or float8 codes with block scales (pellucid.models.fp8_experts), which with
   `quantize_activations` multiply float8 activations (W8A8: each GEMM's input quantized by a `quantize_rows`
   launch first). `fused_expert_rows` stops before the sum, for a residual add + RMSNorm that sums the rows itself
   (pellucid.kernels.add_rms_norm).

Nothing reads device values on the host: buffer sizes and grids depend on the token count alone, so a
CUDA graph captured for a batch size replays any routing, and steps launched ahead never wait.

Tiles (`pick_tiles`): decode-sized batches route few tokens to each expert, so blocks of 16 rows and narrow
gate/up column tiles give many programs streaming the chosen experts' weights (one token of narrow experts keeps
narrow down tiles too); prefill uses 64-row blocks and wide tiles for the tensor cores. Measured in BENCHMARKS.md
(issue 19).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pellucid.kernels.moe_gemm import GemmTile, down_weighted, gate_up_silu, quantize_rows, sum_top_k
from pellucid.models.fp8_experts import FP8_DTYPE
from pellucid.kernels.moe_routing import ExpertLayout, layout_for, route_and_layout

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    gate_up: GemmTile
    down: GemmTile


# Chosen from benchmarks/moe_kernel_bench.py --sweep on an H100 (BENCHMARKS.md, issue 19), Qwen3-30B-A3B layer
# shape, bf16: decode (<= 16 entries per expert) 16-row blocks; mid-size batches 32; prefill 64, and 128 from
# 128 entries per expert on (8k-token prefill, 512 per expert: gate/up 1136 -> 802 us, down 814 -> 801 us per
# layer in the sweep; the engine's 8k prefill in BENCHMARKS.md was measured with the 64-row tiles). Re-swept on an
# H200 (2026-11-29): from 2 tokens on down takes 128 x 128 tiles (97 against 102 us per layer at 64 tokens, 110
# against 113 at 256; the engine's batch 64 / 256 steps 1.5% / 1.0% faster; Mixtral-8x7B's batch 16 8.5%), which
# one token does not (below; 64 x 128 tiles of 2 warps, 9.7 us alone, made the batch-1 step 2.3% slower); mid-size
# down takes 64-deep K steps (173 against 186 us at 1,024 tokens in 32-row blocks); and the 64-row blocks start at
# 32 entries per expert, not 64, for every weight format (one layer at 640 / 1,024 tokens: bf16 433 -> 351 / 528 ->
# 412 us, FP8 451 -> 349 / 586 -> 515, W8A8 341 -> 259 / 438 -> 338; the GEMMs at 512 tokens 4-14% faster; at 384,
# 24 per expert, the 32-row blocks stay equal or faster).
ONE_TOKEN_TILES = MoeTiles(16, GemmTile(32, 128, 4, 4), GemmTile(64, 64, 4, 4))
DECODE_TILES = MoeTiles(16, GemmTile(32, 128, 4, 4), GemmTile(128, 128, 4, 4))
MID_TILES = MoeTiles(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3))
PREFILL_TILES = MoeTiles(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3))
LONG_PREFILL_TILES = MoeTiles(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3))
# Float8 expert weights (`moe_kernel_bench.py --fp8 --sweep` on an H200, BENCHMARKS.md, issue 19): at decode a
# stage holds half the bytes, so wider column tiles and whole 128-column scale blocks per K step; at prefill the
# per-weight dequantization favours 4-warp down tiles. Same block rows as the plain tiles, so the routing's layout
# serves both.
FP8_DECODE_TILES = MoeTiles(16, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 4))
FP8_MID_TILES = MoeTiles(32, GemmTile(128, 128, 4, 3), GemmTile(128, 64, 4, 3))
FP8_PREFILL_TILES = MoeTiles(64, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3))
FP8_LONG_PREFILL_TILES = MoeTiles(128, GemmTile(64, 64, 8, 4), GemmTile(128, 64, 4, 4))
# W8A8 (float8 activations, quantize_rows; `moe_kernel_bench.py --fp8 --fp8-activations --sweep` on an H200,
# BENCHMARKS.md, issue 19): every K step is one 128-column activation group, and the tensor cores take both float8
# operands, so prefill tiles are narrower (64 columns from 512 tokens on: 174 against 223 us for gate/up at 1,024)
# and the longest prefills' down tile takes 8 warps (595 against 1,709 us at 8,192 tokens). Decode and mid-size
# batches keep the FP8 tiles. Same block rows as the plain tiles.
FP8_A8_PREFILL_TILES = MoeTiles(64, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 3))
FP8_A8_LONG_PREFILL_TILES = MoeTiles(128, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 8, 4))
# A lone token's down GEMM streams each chosen expert's [H, I] weights once. With a short K (Qwen3-30B-A3B's I = 768,
# six 128-deep steps) the narrow tiles start more programs sooner: engine batch 1 2.44 ms/step against 2.55 with the
# 128 x 128 tiles; with a long K (Mixtral-8x7B's 14,336) the deeper tiles keep more bytes in flight: 7.77 against
# 8.28 ms/step (H200, BENCHMARKS.md issue 19 round 14).
ONE_TOKEN_NARROW_DOWN_MAX_WIDTH = 1024
# Every family pick_tiles can return, for the checks that run each of them. The W8A8 families are sized for 1-byte
# activations: with 2-byte ones the longest prefills' down tile needs 256 KB of shared memory (an H200 has 227).
A8_TILES = (FP8_A8_PREFILL_TILES, FP8_A8_LONG_PREFILL_TILES)
PLAIN_ACTIVATION_TILES = (ONE_TOKEN_TILES, DECODE_TILES, MID_TILES, PREFILL_TILES, LONG_PREFILL_TILES,
                          FP8_DECODE_TILES, FP8_MID_TILES, FP8_PREFILL_TILES, FP8_LONG_PREFILL_TILES)
ALL_TILES = PLAIN_ACTIVATION_TILES + A8_TILES


def pick_tiles(num_tokens: int, top_k: int, num_experts: int, fp8: bool = False, expert_width: int = 0,
               fp8_activations: bool = False) -> MoeTiles:
    """Tiles for a batch (for 2-byte activations; `fp8`: the expert weights are float8 codes, `fp8_activations`:
    and multiply float8 activations, W8A8; `expert_width`: the experts' intermediate size, 0 where only the block
    rows matter): a function of the shapes alone, so a graph capture records the same kernels."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        if fp8:
            return FP8_DECODE_TILES
        narrow = num_tokens == 1 and expert_width <= ONE_TOKEN_NARROW_DOWN_MAX_WIDTH
        return ONE_TOKEN_TILES if narrow else DECODE_TILES
    if per_expert < 32:
        return FP8_MID_TILES if fp8 else MID_TILES
    if per_expert <= 128:
        if fp8:
            return FP8_A8_PREFILL_TILES if fp8_activations else FP8_PREFILL_TILES
        return PREFILL_TILES
    if fp8:
        return FP8_A8_LONG_PREFILL_TILES if fp8_activations else FP8_LONG_PREFILL_TILES
    return LONG_PREFILL_TILES


def fit_dtype(tiles: MoeTiles, dtype: torch.dtype) -> MoeTiles:
    """Four-byte dtypes take half-depth K tiles: the same shared memory per pipeline stage."""
    if torch.empty((), dtype=dtype).element_size() < 4:
        return tiles
    half = lambda t: GemmTile(t.block_n, max(16, t.block_k // 2), t.num_warps, t.num_stages)  # noqa: E731
    return MoeTiles(tiles.block_m, half(tiles.gate_up), half(tiles.down))


def route_and_align(logits: torch.Tensor, spec, tiles: MoeTiles | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """(ids [T, k] int32, weights [T, k], layout) for router logits [T, E]; `spec` a pellucid.models.moe.MoeSpec."""
    num_tokens, num_experts = logits.shape
    tiles = tiles or pick_tiles(num_tokens, spec.top_k, num_experts)
    return route_and_layout(logits, spec.top_k, spec.normalize_top_k, spec.weights_dtype(logits.dtype),
                            tiles.block_m)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, layout: ExpertLayout | None = None, tiles: MoeTiles | None = None,
                  gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                  quantize_activations: bool = False) -> torch.Tensor:
    """sum_j weights[t, j] * down[ids[t, j]] @ (silu(gate) * up)(x[t]) -> [T, H] in x's dtype.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids and weights [T, k]. `layout`: the one route_and_align
    made for these ids (made here when absent or laid out for other tiles). With `gate_up_scale` and
    `down_scale` the expert weights are float8 codes and these their block scales (pellucid.models.fp8_experts);
    `quantize_activations` then multiplies them by float8 activations (W8A8, pellucid.models.fp8_experts)."""
    rows = fused_expert_rows(x, gate_up, down, ids, weights, layout, tiles, gate_up_scale, down_scale,
                             quantize_activations)
    return sum_top_k(rows, ids.shape[0], ids.shape[1])


def fused_expert_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, layout: ExpertLayout | None = None, tiles: MoeTiles | None = None,
                      gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                      quantize_activations: bool = False) -> torch.Tensor:
    """fused_experts before its top-k sum: [T * k, H], row t * k + j = weights[t, j] * expert ids[t, j]'s output
    for token t (pellucid.kernels.add_rms_norm.add_top_k_rms_norm sums them with the residual add)."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    fp8 = gate_up_scale is not None and down_scale is not None
    weight_dtype = FP8_DTYPE if fp8 else x.dtype
    if x.dtype not in SUPPORTED_DTYPES or gate_up.dtype != weight_dtype or down.dtype != weight_dtype:
        raise ValueError(f"fused MoE needs activations in one of {SUPPORTED_DTYPES} and expert weights in their dtype "
                         f"(or float8 codes with both block scales), got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    if quantize_activations and not fp8:
        raise ValueError("FP8 activations need FP8 expert weights with their block scales")
    if x.stride(-1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError("fused MoE needs activations with unit stride along the hidden dimension and contiguous "
                         "expert weights")
    # FP8 tiles were tuned for 16-bit activations; float32 (the reference dtype) keeps the plain path's tiles.
    fp8_tiles = fp8 and x.dtype.itemsize == 2
    tiles = fit_dtype(tiles or pick_tiles(num_tokens, top_k, num_experts, fp8_tiles, down.shape[-1],
                                          quantize_activations), x.dtype)
    if layout is None or layout.block_m != tiles.block_m:
        layout = layout_for(ids, num_experts, tiles.block_m)
    if quantize_activations:
        assert gate_up_scale is not None and down_scale is not None     # fp8, checked above
        x8 = quantize_rows(x, gate_up.shape[2] // gate_up_scale.shape[2])
        h = gate_up_silu(x8, gate_up, layout, tiles.gate_up, gate_up_scale, out_dtype=x.dtype)
        h8 = quantize_rows(h, down.shape[2] // down_scale.shape[2])
        return down_weighted(h8, down, weights.contiguous(), layout, tiles.down, down_scale, out_dtype=x.dtype)
    h = gate_up_silu(x, gate_up, layout, tiles.gate_up, gate_up_scale if fp8 else None)
    return down_weighted(h, down, weights.contiguous(), layout, tiles.down, down_scale if fp8 else None)
