"""The fused MoE kernels on one Qwen3-30B-A3B layer shape (128 experts, 8 per token, hidden 2048, expert
width 768, bf16): time per layer of routing + experts at decode and prefill token counts, inside CUDA
graphs, against the floor measured in the same run: the bytes of the experts the tokens touched (plus the
router weights) over the copy bandwidth, or the expert FLOPs over the bf16 matmul rate, whichever is larger.

Four layers of random weights are cycled so the experts of one layer are not in L2 when the next reads them.
`--sweep` also times each GEMM over a set of tiles per token count and prints the best (to choose
pellucid.kernels.fused_moe's tiles). `--fp8` keeps the experts as float8 codes with 128 x 128 block scales
(pellucid.models.fp8_experts, as Qwen3-30B-A3B-FP8 publishes them); the floor then counts their bytes.
`--fp8-activations` adds W8A8: activations quantized to float8 per token and 128 columns (the gate_up and down
columns leave out the two quantize_rows launches; the total includes them).

    PYTHONPATH=. python3 benchmarks/moe_kernel_bench.py [--tokens 1,8,64,256,8192] [--sweep] [--fp8 [--fp8-activations]]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from pellucid.bench.common import print_table
from pellucid.bench.floors import measure_floors, print_floors

E, K, H, I = 128, 8, 2048, 768
LAYERS = 4


def _graph_us(fn, repeats: int = 20) -> float:
    """Median over `repeats` replays of a graph running fn once per layer, per layer, in microseconds."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


def _candidates(block_m: int, which: str, fp8: bool, a8: bool = False):
    from pellucid.kernels.moe_gemm import GemmTile
    if a8:      # the K step is the activations' 128-column quantization group
        ns = (32, 64, 128) if block_m <= 32 else (64, 128, 256)
        return [GemmTile(n, 128, w, s) for n in ns for w in (4, 8) for s in (3, 4)]
    if block_m == 16:
        ns = (16, 32, 64) if which == "gate_up" else (32, 64, 128)
        ks = (64, 128) if fp8 else (64, 128, 256)   # an FP8 K step lies in one 128-column scale block
        return [GemmTile(n, k, w, s) for n in ns for k in ks for w in (2, 4) for s in (4, 6, 8)]
    if block_m == 32:
        return [GemmTile(n, k, w, 3) for n in (64, 128) for k in (64, 128) for w in (4, 8)]
    ks = (64, 128) if fp8 else (64,)
    return [GemmTile(n, k, w, s) for n in (64, 128) for k in ks for w in (4, 8) for s in (3, 4)]


def _block_ms(tokens: int) -> list[int]:
    """Block rows to sweep: the ones fused_moe.pick_tiles takes at this token count and their neighbours (a few
    tokens: 16 only)."""
    from pellucid.kernels import fused_moe
    if tokens * K / E <= 8:
        return [16]
    rows = [16, 32, 64, 128]
    at = rows.index(fused_moe.pick_tiles(tokens, K, E).block_m)
    return rows[max(0, at - 1):at + 2]


def main() -> None:
    from pellucid.kernels import fused_moe
    from pellucid.kernels.moe_gemm import down_weighted, gate_up_silu, quantize_rows, sum_top_k
    from pellucid.models.moe import MoeSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,8,64,256,8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="with --fp8: activations quantized to float8 per token and 128 columns (W8A8)")
    args = parser.parse_args()
    if args.fp8_activations and not args.fp8:
        parser.error("--fp8-activations needs --fp8")
    a8 = args.fp8_activations
    floors = measure_floors()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    gate_up = [torch.randn(E, 2 * I, H, device="cuda", dtype=dtype) * H ** -0.5 for _ in range(LAYERS)]
    down = [torch.randn(E, H, I, device="cuda", dtype=dtype) * I ** -0.5 for _ in range(LAYERS)]
    router = [torch.randn(E, H, device="cuda", dtype=dtype) * H ** -0.5 for _ in range(LAYERS)]
    spec = MoeSpec(E, K, True, True)
    expert_bytes = 3 * H * I * 2
    gate_up_scale = down_scale = [None] * LAYERS
    if args.fp8:
        from pellucid.models.fp8_experts import quantize
        gate_up, gate_up_scale = zip(*(quantize(w, (128, 128)) for w in gate_up))
        down, down_scale = zip(*(quantize(w, (128, 128)) for w in down))
        expert_bytes = 3 * H * I + 3 * (H // 128) * (I // 128) * 4

    def run_gate_up(x, layouts, tile):   # W8A8: the GEMMs take quantize_rows' codes (made outside the timing)
        a = quantize_rows(x, 128) if a8 else x
        return [gate_up_silu(a, gate_up[l], layouts[l][2], tile, gate_up_scale[l], dtype) for l in range(LAYERS)]

    def run_down(h, layouts, tile):
        a = [quantize_rows(rows, 128) for rows in h] if a8 else h
        return [down_weighted(a[l], down[l], layouts[l][1], layouts[l][2], tile, down_scale[l], dtype)
                for l in range(LAYERS)]
    rows, sweep_rows = [], []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, H, device="cuda", dtype=dtype)
        logits = [x @ r.T for r in router]
        tiles = fused_moe.pick_tiles(tokens, K, E, args.fp8, I, a8)

        def layer_all(tiles=tiles):
            for l in range(LAYERS):
                ids, weights, layout = fused_moe.route_and_align(logits[l], spec, tiles)
                fused_moe.fused_experts(x, gate_up[l], down[l], ids, weights, layout, tiles, gate_up_scale[l],
                                        down_scale[l], a8)

        routed = [fused_moe.route_and_align(logits[l], spec, tiles) for l in range(LAYERS)]
        touched = statistics.mean(int(torch.unique(r[0]).numel()) for r in routed)
        h = run_gate_up(x, routed, tiles.gate_up)
        y = run_down(h, routed, tiles.down)
        total = _graph_us(layer_all)
        parts = {
            "route+layout": _graph_us(lambda: [fused_moe.route_and_align(logits[l], spec, tiles)
                                               for l in range(LAYERS)]),
            "gate_up": _graph_us(lambda: run_gate_up(x, routed, tiles.gate_up)),
            "down": _graph_us(lambda: run_down(h, routed, tiles.down)),
            "sum": _graph_us(lambda: [sum_top_k(y[l], tokens, K) for l in range(LAYERS)]),
        }
        bytes_floor = floors.bytes_time(touched * expert_bytes + E * H * 2 + 2 * tokens * H * 2) * 1e6
        flops_floor = floors.flops_time(2.0 * tokens * K * 3 * H * I) * 1e6
        floor = max(bytes_floor, flops_floor)
        rows.append([str(tokens), f"{touched:.1f}", f"{total:.1f}", *(f"{v:.1f}" for v in parts.values()),
                     f"{floor:.1f}", "bytes" if bytes_floor >= flops_floor else "FLOPs", f"{total / floor:.2f}x"])
        if args.sweep:
            for block_m in _block_ms(tokens):
                layouts = [fused_moe.route_and_align(logits[l], spec, fused_moe.MoeTiles(block_m, tiles.gate_up,
                                                                                         tiles.down))
                           for l in range(LAYERS)]
                h_rows = run_gate_up(x, layouts, tiles.gate_up)     # down reads rows in this layout's order
                for which in ("gate_up", "down"):
                    best = None
                    for tile in _candidates(block_m, which, args.fp8, a8):
                        if which == "gate_up":
                            fn = lambda tile=tile: run_gate_up(x, layouts, tile)
                        else:
                            fn = lambda tile=tile: run_down(h_rows, layouts, tile)
                        try:
                            us = _graph_us(fn, 10)
                        except Exception as exc:      # a tile Triton cannot build here (shared memory)
                            print(f"tokens {tokens} bm {block_m} {which} {tile}: {type(exc).__name__}")
                            continue
                        print(f"tokens {tokens} bm {block_m} {which} {tile}: {us:.1f} us")
                        if best is None or us < best[0]:
                            best = (us, tile)
                    sweep_rows.append([str(tokens), str(block_m), which, f"{best[0]:.1f}", str(best[1])])
    print_floors(floors)
    print(f"\nper layer, microseconds (median of graph replays over {LAYERS} layers of random weights); floor = "
          "touched experts' bytes + router weights + x and the output over the copy bandwidth, or the experts' "
          "FLOPs over the matmul rate")
    print_table(["tokens", "experts touched", "total us", "route+layout", "gate_up", "down", "sum", "floor us",
                 "bound", "total / floor"], rows)
    if sweep_rows:
        print()
        print_table(["tokens", "block_m", "gemm", "best us", "tile"], sweep_rows)


if __name__ == "__main__":
    main()
