"""FP8 projections (pellucid.kernels.fp8_linear) against the bf16 path the engine runs without them.

    python3 benchmarks/fp8_linear_bench.py [--rows 1,2,8,...] [--sweep]

For projection shapes of Qwen3-30B-A3B (attention) and Llama-3.1-8B (attention and MLP) and each row count: the bf16
weight through the engine's bf16 path (`layers.linear`: the skinny GEMM where it applies, else cuBLAS), the FP8
codes through the kernel `fp8_linear_cuda` picks, through the tiled kernel and through dequantize + cuBLAS; the
floor is the FP8 codes' and scales' bytes over the copy bandwidth measured in the same run. --sweep also times a
grid of tiled-kernel tiles at a few row counts. Times are medians of CUDA-graph replays of back-to-back calls that
rotate over enough weight copies to miss the L2 cache (skinny_gemm_bench.py's method).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from pellucid.bench.floors import measure_floors
from pellucid.kernels.fp8_linear import (TiledFp8Config, dequantize_weight, fp8_linear_cuda, fp8_tiled_linear,
                                         pick_tiled_config)
from pellucid.models.fp8_experts import quantize
from pellucid.models.layers import linear
from skinny_gemm_bench import ROTATE_BYTES, graph_time_us, print_table

SHAPES = [("Qwen3-30B-A3B qkv", 5120, 2048), ("Qwen3-30B-A3B o", 2048, 4096), ("Llama-3.1-8B qkv", 6144, 4096),
          ("Llama-3.1-8B o", 4096, 4096), ("Llama-3.1-8B gate_up", 28672, 4096), ("Llama-3.1-8B down", 4096, 14336)]
BLOCK = (128, 128)


def sweep_configs(rows: int) -> list[TiledFp8Config]:
    block_rows = (16,) if rows <= 16 else (32, 64) if rows <= 64 else (64, 128)
    return [TiledFp8Config(m, n, k, w, s) for m, n, k, w, s in itertools.product(
        block_rows, (32, 64, 128), (64, 128), (4, 8), (3, 4))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,32,64,128,256,512,1024,4096")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    floors = measure_floors(copy_gib=1.0, matmul_n=4096)
    print(f"{floors.device_name}: copy bandwidth {floors.copy_bytes_per_s / 1e12:.2f} TB/s (read + write)")
    table, sweep_rows = [], []
    torch.manual_seed(0)
    for shape, n, k in SHAPES:
        copies = max(1, min(16, ROTATE_BYTES // (n * k)))
        plain = [torch.randn(n, k, device="cuda").mul_(k ** -0.5) for _ in range(copies)]
        quantized = [quantize(w, BLOCK) for w in plain]
        bf16 = [w.to(torch.bfloat16) for w in plain]
        del plain
        floor_us = floors.bytes_time(n * k + quantized[0][1].numel() * 4) * 1e6
        bf16_floor_us = floors.bytes_time(n * k * 2) * 1e6
        for m in rows:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            base = graph_time_us(lambda i: linear(xs[i], bf16[i], None), copies)
            fp8 = graph_time_us(lambda i: fp8_linear_cuda(xs[i], *quantized[i]), copies)
            tiled = graph_time_us(lambda i: fp8_tiled_linear(xs[i], *quantized[i]), copies) if m > 1 else None
            dequantized = graph_time_us(lambda i: torch.nn.functional.linear(
                xs[i], dequantize_weight(*quantized[i], torch.bfloat16)), copies) if m >= 64 else None
            row = [shape, m, f"{base:.2f}", f"{fp8:.2f}", "-" if tiled is None else f"{tiled:.2f}",
                   "-" if dequantized is None else f"{dequantized:.2f}", f"{floor_us:.2f}", f"{bf16_floor_us:.2f}",
                   f"{fp8 / base:.2f}", f"{fp8 / floor_us:.2f}"]
            table.append(row)
            print("row", *row, sep=" ; ", flush=True)
            if args.sweep and m in (2, 16, 64, 256) and shape in ("Qwen3-30B-A3B qkv", "Llama-3.1-8B gate_up"):
                timed = []
                for config in sweep_configs(m):
                    try:
                        timed.append((graph_time_us(lambda i: fp8_tiled_linear(xs[i], *quantized[i], None, config),
                                                    copies), config))
                    except triton.runtime.errors.OutOfResources:
                        continue        # the tile does not fit the SM's shared memory
                best = min(timed, key=lambda pair: pair[0])
                sweep_rows.append([shape, m, pick_tiled_config(m, BLOCK[1]), "-" if tiled is None else f"{tiled:.2f}",
                                   best[1], f"{best[0]:.2f}"])
                print("sweep", *sweep_rows[-1], sep=" ; ", flush=True)
        quantized = bf16 = []      # free the weights before the next shape
        torch.cuda.empty_cache()
    print_table(["shape", "M", "bf16 path us", "FP8 us (picked)", "FP8 tiled us", "FP8 dequantize + cuBLAS us",
                 "FP8 bytes floor us", "bf16 bytes floor us", "FP8 / bf16", "FP8 / its floor"], table)
    if sweep_rows:
        print_table(["shape", "M", "picked tile", "picked us", "best tile", "best us"], sweep_rows)


if __name__ == "__main__":
    main()
