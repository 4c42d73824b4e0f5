"""Skinny decode GEMMs (pellucid.kernels.skinny_gemm) against cuBLAS and the weight-bytes floor.

    python3 benchmarks/skinny_gemm_bench.py [--sweep] [--models Qwen3-0.6B,Llama-3.2-1B,Llama-3.1-8B]

For each projection shape of the named models, and their LM head, and M in 1, 2, 4, 8, 16: torch (cuBLAS) us per call, the
skinny kernel with its chosen tile (`pick_config`), and with --sweep the best of a grid of tiles; the floor
is the weight bytes over the device-to-device copy bandwidth measured in the same run. Then the down
projection with silu(gate) * up: unfused (silu_and_mul kernel + cuBLAS, and + skinny GEMM) against the
fused kernel. Times are medians of CUDA-graph replays of many back-to-back calls that rotate over enough
weight copies to miss the L2 cache.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from pellucid.bench.floors import measure_floors
from pellucid.kernels import skinny_gemm
from pellucid.kernels.silu_and_mul import silu_and_mul
from pellucid.kernels.skinny_gemm import SkinnyConfig

# (hidden, q heads * head_dim, kv heads * head_dim, intermediate) of each model.
MODEL_DIMS = {
    "Qwen3-0.6B": (1024, 16 * 128, 8 * 128, 3072),
    "Llama-3.2-1B": (2048, 32 * 64, 8 * 64, 8192),
    "Llama-3.1-8B": (4096, 32 * 128, 8 * 128, 14336),
}
VOCAB = {"Qwen3-0.6B": 151936, "Llama-3.2-1B": 128256, "Llama-3.1-8B": 128256}    # the LM head's rows
ROWS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 256 * 2**20      # weight copies per graph: more than 5x the H100's 50 MB L2


def projection_shapes(model: str) -> list[tuple[str, int, int]]:
    hidden, q, kv, inter = MODEL_DIMS[model]
    return [("qkv", q + 2 * kv, hidden), ("o", hidden, q), ("gate_up", 2 * inter, hidden), ("down", hidden, inter),
            ("head", VOCAB[model], hidden)]


def sweep_configs(m: int) -> list[SkinnyConfig]:
    block_m = 1 << (m - 1).bit_length()
    configs = []
    if block_m <= 8:
        for block_n in (4, 8, 16, 32):
            for block_k in (512, 1024):
                for warps in (4, 8):
                    # broadcast product held in registers: keep it near 128 fp32 values per thread
                    if block_m * block_n * block_k <= 128 * 32 * warps:
                        configs.append(SkinnyConfig(block_m, block_n, block_k, warps, 3, False))
    for block_n, block_k, warps, stages in ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4)):
        configs.append(SkinnyConfig(16, block_n, block_k, warps, stages, True))
    return configs


def graph_time_us(call: Callable[[int], torch.Tensor], copies: int) -> float:
    """Median us per call of a CUDA graph of back-to-back calls over `copies` operand sets."""
    calls = max(copies, 32 // copies * copies)
    for i in range(copies):     # compile and warm up outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            call(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def fmt(config: SkinnyConfig) -> str:
    kind = "dot" if config.use_dot else "fma"
    return f"{kind} m{config.block_m} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODEL_DIMS))
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles and report the best")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    floors = measure_floors(copy_gib=1.0, matmul_n=4096)
    print(f"{floors.device_name}: copy bandwidth {floors.copy_bytes_per_s / 1e12:.2f} TB/s (read + write)")
    gemm_rows, silu_rows, crossover = [], [], {}
    torch.manual_seed(0)
    for model in args.models.split(","):
        for name, n, k in projection_shapes(model):
            weight_bytes = n * k * dtype.itemsize
            copies = max(1, min(32, ROTATE_BYTES // weight_bytes))
            weights = [torch.randn(n, k, device="cuda").to(dtype) for _ in range(copies)]
            floor_us = floors.bytes_time(weight_bytes) * 1e6
            shape = f"{model} {name} [{n}x{k}]"
            best_m = 0
            for m in ROWS:
                xs = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(copies)]
                cublas = graph_time_us(lambda i: torch.nn.functional.linear(xs[i], weights[i]), copies)
                chosen = skinny_gemm.pick_config(m, n, k)
                picked = graph_time_us(lambda i: skinny_gemm.linear(xs[i], weights[i]), copies) if chosen else None
                best, best_config = picked, chosen
                if args.sweep:
                    for config in sweep_configs(m):
                        t = graph_time_us(lambda i: skinny_gemm.linear(xs[i], weights[i], config=config), copies)
                        if best is None or t < best:
                            best, best_config = t, config
                if best is not None and best < cublas:
                    best_m = m
                gemm_rows.append(row := [shape, m, f"{cublas:.2f}", "-" if picked is None else f"{picked:.2f}",
                                  "-" if best is None else f"{best:.2f}", "-" if best_config is None else fmt(best_config),
                                  f"{floor_us:.2f}", "-" if picked is None else f"{cublas / picked:.2f}",
                                  "-" if best is None else f"{best / floor_us:.2f}"])
                print("row", *row, sep=" ; ", flush=True)     # progress, in case the run is cut short
                if name == "down":
                    gate_ups = [torch.randn(m, 2 * k, device="cuda").to(dtype) for _ in range(copies)]

                    def unfused(i: int, skinny: bool) -> torch.Tensor:
                        act = silu_and_mul(gate_ups[i][:, :k], gate_ups[i][:, k:])
                        return skinny_gemm.linear(act, weights[i]) if skinny else \
                            torch.nn.functional.linear(act, weights[i])
                    plain = graph_time_us(lambda i: unfused(i, False), copies)
                    two = graph_time_us(lambda i: unfused(i, True), copies) if chosen else None
                    fused_chosen = skinny_gemm.pick_config(m, n, k, silu_mul=True)
                    tiles = [fused_chosen] + [SkinnyConfig(1 << (m - 1).bit_length(), block_n, 1024, 4, 3, False)
                                              for block_n in (4, 8, 16)] if m <= 2 else [fused_chosen]
                    fused = []
                    for config in tiles:
                        fused.append(None if config is None else graph_time_us(
                            lambda i: skinny_gemm.silu_mul_linear(gate_ups[i], weights[i], config=config), copies))
                    fused += [None] * (4 - len(fused))
                    silu_rows.append([shape, m, f"{plain:.2f}", "-" if two is None else f"{two:.2f}"]
                                     + ["-" if t is None else f"{t:.2f}" for t in fused]
                                     + ["-" if fused[0] is None else f"{plain / fused[0]:.2f}"])
            crossover[shape] = best_m
            del weights
            torch.cuda.empty_cache()
    print_table(["shape", "M", "cuBLAS us", "skinny us", "best us", "best tile", "floor us", "cuBLAS/skinny",
                 "best/floor"], gemm_rows)
    print_table(["down shape", "M", "silu_and_mul+cuBLAS us", "silu_and_mul+skinny us", "fused (picked tile) us",
                 "fused n4 us", "fused n8 us", "fused n16 us", "unfused/fused"], silu_rows)
    print_table(["shape", "largest M where skinny beats cuBLAS"], [[s, m] for s, m in crossover.items()])


def print_table(header: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
