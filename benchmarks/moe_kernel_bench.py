"""The fused MoE kernels on one Qwen3-30B-A3B layer shape (128 experts, 8 per token, hidden 2048, expert
width 768, bf16): time per layer of routing + experts at decode and prefill token counts, inside CUDA
graphs, against the floor measured in the same run: the bytes of the experts the tokens touched (plus the
router weights) over the copy bandwidth, or the expert FLOPs over the bf16 matmul rate, whichever is larger.

Both paths of pellucid.kernels.fused_moe are timed side by side in the same run: "grouped" (routing, token
layout, grouped tensor-core GEMMs, top-k sum) at every token count, and "rows" (routing inside the gate/up
kernel, top-k sum inside the down kernel; moe_rows.py) up to --row-tokens tokens. "total" is routing +
experts from given router logits; "+ router" adds the router GEMM in front (as the model runs it), since a
kernel's PDL wait overlaps differently with what precedes it. The default path per token count is
fused_moe.pick_path's (marked "*").

Four layers of random weights are cycled so the experts of one layer are not in L2 when the next reads them.
`--sweep` also times each GEMM over a set of tiles per token count and prints the best (to choose
pellucid.kernels.fused_moe's tiles; the row path's from --row-tokens tokens down).

    PYTHONPATH=. python3 benchmarks/moe_kernel_bench.py [--tokens 1,2,4,8,64,256,8192] [--row-tokens 8] [--sweep]
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


def _grouped_candidates(block_m: int, which: str):
    from pellucid.kernels.moe_gemm import GemmTile
    if block_m == 16:
        ns = (16, 32, 64) if which == "gate_up" else (32, 64, 128)
        return [GemmTile(n, k, 4, 4) for n in ns for k in (64, 128, 256)]
    if block_m == 32:
        return [GemmTile(n, k, w, 3) for n in (64, 128) for k in (64, 128) for w in (4, 8)]
    return [GemmTile(n, 64, w, s) for n in (64, 128) for w in (4, 8) for s in (3, 4)]


def _row_candidates(which: str):
    """Row tiles around fused_moe's choice: weight bytes per program step 8-32 KB, 4 or 8 warps, 1-3 stages."""
    from pellucid.kernels.moe_rows import RowTile
    if which == "gate_up":
        shapes = [(4, 512), (8, 256), (8, 512), (16, 256), (4, 1024), (8, 1024)]
    else:
        shapes = [(2, 256), (4, 128), (4, 256), (8, 128), (8, 256), (2, 512)]
    return [RowTile(n, k, w, s) for n, k in shapes for w in (4, 8) for s in (1, 3)]


def _block_ms(tokens: int) -> list[int]:
    per_expert = tokens * K / E
    return [16] if per_expert <= 8 else [16, 32] if per_expert <= 32 else [64, 128]


def _best(fns: dict) -> tuple[float, object]:
    """(us, key) of the fastest of {key: fn}; keys Triton cannot build here (shared memory) are reported."""
    best = None
    for key, fn in fns.items():
        try:
            us = _graph_us(fn, 10)
        except Exception as exc:
            print(f"{key}: {type(exc).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, key)
    return best


def main() -> None:
    from pellucid.kernels import fused_moe
    from pellucid.kernels.moe_gemm import down_weighted, gate_up_silu, sum_top_k
    from pellucid.kernels.moe_rows import down_sum_rows, route_gate_up_rows
    from pellucid.models.layers import linear
    from pellucid.models.moe import MoeSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,2,4,8,64,256,8192")
    parser.add_argument("--row-tokens", type=int, default=8, help="time the row path up to this many tokens")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    floors = measure_floors()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    gate_up = [torch.randn(E, 2 * I, H, device="cuda", dtype=dtype) * H ** -0.5 for _ in range(LAYERS)]
    down = [torch.randn(E, H, I, device="cuda", dtype=dtype) * I ** -0.5 for _ in range(LAYERS)]
    router = [torch.randn(E, H, device="cuda", dtype=dtype) * H ** -0.5 for _ in range(LAYERS)]
    spec = MoeSpec(E, K, True, True)
    expert_bytes = 3 * H * I * 2
    row_gate_up, row_down = fused_moe.row_tiles(dtype)
    rows, part_rows, sweep_rows = [], [], []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, H, device="cuda", dtype=dtype)
        logits = [x @ r.T for r in router]
        tiles = fused_moe.pick_tiles(tokens, K, E)
        routed = [fused_moe.route_and_align(logits[l], spec, tiles) for l in range(LAYERS)]
        touched = statistics.mean(int(torch.unique(r[0]).numel()) for r in routed)
        bytes_floor = floors.bytes_time(touched * expert_bytes + E * H * 2 + 2 * tokens * H * 2) * 1e6
        flops_floor = floors.flops_time(2.0 * tokens * K * 3 * H * I) * 1e6
        floor = max(bytes_floor, flops_floor)
        paths = ["grouped"] + (["rows"] if tokens <= args.row_tokens else [])
        for path in paths:
            def layer(path=path):
                for l in range(LAYERS):
                    fused_moe.routed_experts(x, logits[l], gate_up[l], down[l], spec, path=path)

            def layer_with_router(path=path):
                for l in range(LAYERS):
                    fused_moe.routed_experts(x, linear(x, router[l], None), gate_up[l], down[l], spec, path=path)

            if path == "grouped":
                h = [gate_up_silu(x, gate_up[l], routed[l][2], tiles.gate_up) for l in range(LAYERS)]
                y = [down_weighted(h[l], down[l], routed[l][1], routed[l][2], tiles.down) for l in range(LAYERS)]
                parts = {
                    "route+layout": lambda: [fused_moe.route_and_align(logits[l], spec, tiles) for l in range(LAYERS)],
                    "gate_up": lambda: [gate_up_silu(x, gate_up[l], routed[l][2], tiles.gate_up)
                                        for l in range(LAYERS)],
                    "down": lambda: [down_weighted(h[l], down[l], routed[l][1], routed[l][2], tiles.down)
                                     for l in range(LAYERS)],
                    "sum": lambda: [sum_top_k(y[l], tokens, K) for l in range(LAYERS)],
                }
            else:
                rowed = [route_gate_up_rows(x, logits[l], gate_up[l], K, True, dtype, row_gate_up)
                         for l in range(LAYERS)]
                parts = {
                    "route+gate_up": lambda: [route_gate_up_rows(x, logits[l], gate_up[l], K, True, dtype, row_gate_up)
                                              for l in range(LAYERS)],
                    "down+sum": lambda: [down_sum_rows(rowed[l][2], down[l], rowed[l][0], rowed[l][1], row_down)
                                         for l in range(LAYERS)],
                }
            total = _graph_us(layer)
            mark = "*" if fused_moe.pick_path(tokens) == path else ""
            with_router = _graph_us(layer_with_router)
            rows.append([str(tokens), path + mark, f"{touched:.1f}", f"{total:.1f}", f"{with_router:.1f}",
                         f"{floor:.1f}", "bytes" if bytes_floor >= flops_floor else "FLOPs", f"{total / floor:.2f}x"])
            timed = ", ".join(f"{name} {_graph_us(fn):.1f}" for name, fn in parts.items())
            part_rows.append([str(tokens), path, timed])
        if args.sweep:
            for block_m in _block_ms(tokens):
                layouts = [fused_moe.route_and_align(logits[l], spec, fused_moe.MoeTiles(block_m, tiles.gate_up,
                                                                                         tiles.down))
                           for l in range(LAYERS)]
                hb = [gate_up_silu(x, gate_up[l], layouts[l][2], tiles.gate_up) for l in range(LAYERS)]
                best = _best({t: lambda t=t: [gate_up_silu(x, gate_up[l], layouts[l][2], t) for l in range(LAYERS)]
                              for t in _grouped_candidates(block_m, "gate_up")})
                grouped = f"grouped, block_m {block_m}"
                sweep_rows.append([str(tokens), grouped, "gate_up", f"{best[0]:.1f}", str(best[1])])
                best = _best({t: lambda t=t: [down_weighted(hb[l], down[l], layouts[l][1], layouts[l][2], t)
                                              for l in range(LAYERS)] for t in _grouped_candidates(block_m, "down")})
                sweep_rows.append([str(tokens), grouped, "down", f"{best[0]:.1f}", str(best[1])])
            if tokens <= args.row_tokens:
                rowed = [route_gate_up_rows(x, logits[l], gate_up[l], K, True, dtype, row_gate_up)
                         for l in range(LAYERS)]
                best = _best({t: lambda t=t: [route_gate_up_rows(x, logits[l], gate_up[l], K, True, dtype, t)
                                              for l in range(LAYERS)] for t in _row_candidates("gate_up")})
                sweep_rows.append([str(tokens), "rows", "route+gate_up", f"{best[0]:.1f}", str(best[1])])
                best = _best({t: lambda t=t: [down_sum_rows(rowed[l][2], down[l], rowed[l][0], rowed[l][1], t)
                                              for l in range(LAYERS)] for t in _row_candidates("down")})
                sweep_rows.append([str(tokens), "rows", "down+sum", f"{best[0]:.1f}", str(best[1])])
    print_floors(floors)
    print(f"\nper layer, microseconds (median of graph replays over {LAYERS} layers of random weights); total = "
          "routing + experts from router logits, + router = with the router GEMM before it; floor = touched "
          "experts' bytes + router weights + x and the output over the copy bandwidth, or the experts' FLOPs over "
          "the matmul rate; * = the path fused_moe.pick_path takes")
    print_table(["tokens", "path", "experts touched", "total us", "+ router us", "floor us", "bound",
                 "total / floor"], rows)
    print()
    print_table(["tokens", "path", "parts, us per layer (each timed alone)"], part_rows)
    if sweep_rows:
        print()
        print_table(["tokens", "path", "gemm", "best us", "tile"], sweep_rows)


if __name__ == "__main__":
    main()
