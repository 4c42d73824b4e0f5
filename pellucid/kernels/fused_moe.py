"""The fused mixture-of-experts MLP on the GPU: routing, token layout, two grouped GEMMs and the top-k sum.

Per MoE layer (pellucid.models.moe calls these while `fused_kernels_enabled(x, "moe")`):
1. the router GEMM (the `gate` module, an ordinary linear layer);
2. `route_and_align`: softmax, top-k, renormalisation, then the entries grouped by expert in blocks of
   `block_m` rows (moe_routing.py, two launches);
3. `fused_experts`: the gate/up grouped GEMM with SiLU-and-mul, the down grouped GEMM weighted by the
   routing weights, and the sum over each token's experts (moe_gemm.py).

Nothing reads device values on the host: buffer sizes and grids depend on the token count alone, so a
CUDA graph captured for a batch size replays any routing, and steps launched ahead never wait.

Two paths (`uses_row_path` picks one from the token count alone):
- rows (moe_rows.py), up to `row_path_max_tokens()` tokens: the routing inside the gate/up GEMM and the
  top-k sum inside the down GEMM, one program per entry and column tile on the CUDA cores; two launches
  after the router GEMM;
- grouped (steps 2-3 above), beyond: entries grouped by expert in blocks for the tensor cores.

Tiles (`pick_tiles`): decode-sized batches route few tokens to each expert, so blocks of 16 rows and narrow
column tiles give many programs streaming the chosen experts' weights; prefill uses 64-row blocks and wide
tiles for the tensor cores. Measured in BENCHMARKS.md (issue 19).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pellucid.kernels.moe_gemm import GemmTile, down_weighted, gate_up_silu, sum_top_k
from pellucid.kernels.moe_routing import ExpertLayout, layout_for, route_and_layout
from pellucid.kernels.moe_rows import RowTile, down_sum_rows, gate_up_rows, route_gate_up_rows

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    gate_up: GemmTile
    down: GemmTile


# Chosen from benchmarks/moe_kernel_bench.py --sweep on an H100 (BENCHMARKS.md, issue 19), Qwen3-30B-A3B layer
# shape, bf16: decode (<= 16 entries per expert) 16-row blocks; mid-size batches 32; prefill 64, and 128 from
# 128 entries per expert on (8k-token prefill, 512 per expert: gate/up 1136 -> 802 us, down 814 -> 801 us per
# layer in the sweep; the engine's 8k prefill in BENCHMARKS.md was measured with the 64-row tiles).
DECODE_TILES = MoeTiles(16, GemmTile(32, 128, 4, 4), GemmTile(64, 64, 4, 4))
MID_TILES = MoeTiles(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3))
PREFILL_TILES = MoeTiles(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3))
LONG_PREFILL_TILES = MoeTiles(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3))


def pick_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """Tiles for a batch (for 2-byte dtypes): a function of the shapes alone, so a graph capture records the
    same kernels."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return DECODE_TILES
    if per_expert <= 64:
        return MID_TILES
    return PREFILL_TILES if per_expert <= 128 else LONG_PREFILL_TILES


def fit_dtype(tiles: MoeTiles, dtype: torch.dtype) -> MoeTiles:
    """Four-byte dtypes take half-depth K tiles: the same shared memory per pipeline stage."""
    if torch.empty((), dtype=dtype).element_size() < 4:
        return tiles
    half = lambda t: GemmTile(t.block_n, max(16, t.block_k // 2), t.num_warps, t.num_stages)  # noqa: E731
    return MoeTiles(tiles.block_m, half(tiles.gate_up), half(tiles.down))


PATHS = ("rows", "grouped")
# Up to this many tokens the row path runs (PELLUCID_MOE_ROW_MAX_TOKENS overrides it; 0 turns the path off).
# At 1 token it reads the same bytes as the grouped path (a token's top-k experts are distinct) in three
# fewer launches: ~6.6 us of routing + layout and ~4 us of top-k sum per Qwen3-30B-A3B layer on the H100
# (BENCHMARKS.md, issue 19), against ~1 us of routing inside the gate/up programs. Past 1 token it reads an
# expert once per entry that chose it (L2 serves the repeats only when their programs run together): at 4
# tokens of Qwen3-30B-A3B ~32 entries hit ~29 experts, at 8 tokens 64 entries hit ~50, where the grouped
# path is already within 1.12x of its bytes, so the row path stops at 4. Not yet measured past 1 token:
# benchmarks/moe_kernel_bench.py times both paths at 1, 2, 4 and 8 tokens to set it.
ROW_PATH_MAX_TOKENS = 4
# Row tiles, for 2-byte dtypes, sized for Qwen3-30B-A3B (H 2048, I 768, top-8) at 1 token. Neither GEMM has
# anything to load before its PDL wait (the experts come from the previous kernel's output), so each program
# keeps a 16 KB weight tile per loop step in flight and several programs share an SM:
# - gate/up: 8 gate + 8 up rows x 512 columns per step, 4 steps over H; 8 entries x 96 column tiles = 768
#   programs (~6 per SM); two [8, 512] fp32 accumulators are 64 registers per thread at 4 warps;
# - down: all 8 experts x 4 rows x 256 columns per step, 3 steps over I; 2048 / 4 = 512 programs (~4 per SM).
# Unmeasured: `moe_kernel_bench.py --sweep` times the alternatives.
ROW_GATE_UP_TILE = RowTile(8, 512, 4, 3)
ROW_DOWN_TILE = RowTile(4, 256, 4, 3)


def row_path_max_tokens() -> int:
    setting = os.environ.get("PELLUCID_MOE_ROW_MAX_TOKENS")
    if setting is None:
        return ROW_PATH_MAX_TOKENS
    if not setting.isdigit():
        raise ValueError(f"PELLUCID_MOE_ROW_MAX_TOKENS must be a token count (0 turns the row path off), "
                         f"got {setting!r}")
    return int(setting)


def pick_path(num_tokens: int) -> str:
    """"rows" or "grouped" for a batch: a function of the token count alone, so a graph capture records the
    same kernels."""
    return "rows" if num_tokens <= row_path_max_tokens() else "grouped"


def row_tiles(dtype: torch.dtype) -> tuple[RowTile, RowTile]:
    """(gate/up tile, down tile) of the row path; four-byte dtypes take half-width K steps (the same bytes)."""
    if torch.empty((), dtype=dtype).element_size() < 4:
        return ROW_GATE_UP_TILE, ROW_DOWN_TILE
    half = lambda t: RowTile(t.block_n, t.block_k // 2, t.num_warps, t.num_stages)  # noqa: E731
    return half(ROW_GATE_UP_TILE), half(ROW_DOWN_TILE)


def route_and_align(logits: torch.Tensor, spec, tiles: MoeTiles | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """(ids [T, k] int32, weights [T, k], layout) for router logits [T, E]; `spec` a pellucid.models.moe.MoeSpec."""
    num_tokens, num_experts = logits.shape
    tiles = tiles or pick_tiles(num_tokens, spec.top_k, num_experts)
    return route_and_layout(logits, spec.top_k, spec.normalize_top_k, spec.weights_dtype(logits.dtype),
                            tiles.block_m)


def _check_operands(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"fused MoE needs one dtype of {SUPPORTED_DTYPES} for the activations and expert weights, "
                         f"got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    if x.stride(-1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError("fused MoE needs activations with unit stride along the hidden dimension and contiguous "
                         "expert weights")


def routed_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, spec,
                   path: str | None = None) -> torch.Tensor:
    """The experts' routing-weighted output [T, H] from router logits [T, E]: routing and experts together
    (the MoE block while neither its routing nor its experts are observed). `path`: one of PATHS, else
    `pick_path`'s."""
    _check_operands(x, gate_up, down)
    logits = logits.contiguous()
    if (path or pick_path(x.shape[0])) == "rows":
        gate_up_tile, down_tile = row_tiles(x.dtype)
        ids, weights, h = route_gate_up_rows(x, logits, gate_up, spec.top_k, spec.normalize_top_k,
                                             spec.weights_dtype(logits.dtype), gate_up_tile)
        return down_sum_rows(h, down, ids, weights, down_tile)
    ids, weights, layout = route_and_align(logits, spec)
    return fused_experts(x, gate_up, down, ids, weights, layout, path="grouped")


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, layout: ExpertLayout | None = None, tiles: MoeTiles | None = None,
                  path: str | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down[ids[t, j]] @ (silu(gate) * up)(x[t]) -> [T, H] in x's dtype.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids and weights [T, k]. `layout`: the one route_and_align
    made for these ids (made here when absent or laid out for other tiles). `path`: one of PATHS; unset, the
    grouped path when `tiles` are given (they are its tiles), else `pick_path`'s."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    _check_operands(x, gate_up, down)
    path = path or ("grouped" if tiles is not None else pick_path(num_tokens))
    if path == "rows":
        gate_up_tile, down_tile = row_tiles(x.dtype)
        ids, weights = ids.contiguous(), weights.contiguous()
        return down_sum_rows(gate_up_rows(x, gate_up, ids, gate_up_tile), down, ids, weights, down_tile)
    if path != "grouped":
        raise ValueError(f"unknown fused MoE path {path!r}; known: {', '.join(PATHS)}")
    tiles = fit_dtype(tiles or pick_tiles(num_tokens, top_k, num_experts), x.dtype)
    if layout is None or layout.block_m != tiles.block_m:
        layout = layout_for(ids, num_experts, tiles.block_m)
    h = gate_up_silu(x, gate_up, layout, tiles.gate_up)
    y = down_weighted(h, down, weights.contiguous(), layout, tiles.down)
    return sum_top_k(y, num_tokens, top_k)
