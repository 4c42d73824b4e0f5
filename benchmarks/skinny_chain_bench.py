"""Skinny GEMM tiles timed where they run: in a chain of decoder layers replayed from a CUDA graph.

    python3 benchmarks/skinny_chain_bench.py [--model Qwen3-0.6B] [--layers 28] [--rows 1]

`skinny_gemm_bench.py` times one projection shape at a time. In a decode step every projection follows
a small kernel it depends on, and with programmatic dependent launch a GEMM's weight loads overlap its
predecessor, so the tile that is fastest alone need not be fastest in the chain. This builds `--layers`
layers of the model's shapes (add+RMSNorm, q/k/v, o, add+RMSNorm, gate/up, SiLU-and-mul fused into down;
no attention) with their own weights, captures the chain in a CUDA graph and reports us per layer: first
with `pick_config`'s tiles, then sweeping one projection's tile at a time with the others as picked, then
with the best tile of each. The floor is the layer's weight bytes over the copy bandwidth measured in the
same run.
"""
from __future__ import annotations

import argparse

import torch
import triton

from skinny_gemm_bench import graph_time_us     # benchmarks/ is on sys.path when run as a script

from pellucid.bench.floors import measure_floors
from pellucid.kernels import skinny_gemm
from pellucid.kernels.add_rms_norm import add_rms_norm
from pellucid.kernels.skinny_gemm import SkinnyConfig

MODEL_DIMS = {   # hidden, q heads * head_dim, kv heads * head_dim, intermediate
    "Qwen3-0.6B": (1024, 2048, 1024, 3072),
    "Llama-3.2-1B": (2048, 2048, 512, 8192),
    "Llama-3.1-8B": (4096, 4096, 1024, 14336),
}
ROLES = ("qkv", "o", "gate_up", "down")


class Chain:
    def __init__(self, model: str, layers: int, rows: int, dtype: torch.dtype) -> None:
        hidden, q, kv, inter = MODEL_DIMS[model]
        self.q, self.rows = q, rows
        self.shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        scale = hidden ** -0.5
        self.weights = [{role: (torch.randn(n, k, device="cuda") * scale).to(dtype) for role, (n, k) in self.shapes.items()}
                        for _ in range(layers)]
        self.norm = torch.ones(hidden, device="cuda", dtype=dtype)
        self.x = torch.randn(rows, hidden, device="cuda").to(dtype)

    def layer_bytes(self) -> int:
        return sum(n * k * 2 for n, k in self.shapes.values())

    def forward(self, configs: dict[str, SkinnyConfig | None]) -> torch.Tensor:
        x, residual = self.x, torch.zeros_like(self.x)
        for w in self.weights:
            residual, h = add_rms_norm(x, residual, self.norm, 1e-6)
            qkv = skinny_gemm.linear(h, w["qkv"], config=configs["qkv"])
            x = skinny_gemm.linear(qkv[:, :self.q], w["o"], config=configs["o"])
            residual, h = add_rms_norm(x, residual, self.norm, 1e-6)
            gate_up = skinny_gemm.linear(h, w["gate_up"], config=configs["gate_up"])
            x = skinny_gemm.silu_mul_linear(gate_up, w["down"], config=configs["down"])
        return x

    def time_us_per_layer(self, configs: dict[str, SkinnyConfig | None]) -> float:
        """Median us per layer of CUDA-graph replays of back-to-back forwards (skinny_gemm_bench's timer)."""
        return graph_time_us(lambda _: self.forward(configs), 1) / len(self.weights)


def candidates(role: str, rows: int, k: int) -> list[SkinnyConfig]:
    block_m = triton.next_power_of_2(rows)
    out = []
    for block_k in sorted({512, 1024, triton.next_power_of_2(k)}):
        for block_n in (4, 8, 16, 32):
            for warps in (4, 8):
                per_thread = block_m * block_n * block_k // (32 * warps)
                if 8 <= per_thread <= 64:
                    out.append(SkinnyConfig(block_m, block_n, block_k, warps, 3, False))
    return out


def fmt(config: SkinnyConfig | None) -> str:
    if config is None:
        return "picked"
    return f"n{config.block_n} k{config.block_k} w{config.num_warps}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-0.6B", choices=list(MODEL_DIMS))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    floors = measure_floors(copy_gib=1.0, matmul_n=4096)
    torch.manual_seed(0)
    chain = Chain(args.model, args.layers, args.rows, torch.bfloat16)
    floor_us = floors.bytes_time(chain.layer_bytes()) * 1e6
    picked = {role: None for role in ROLES}
    base = chain.time_us_per_layer(picked)
    print(f"{floors.device_name}, {args.model}, {args.rows} row(s), {args.layers} layers: picked tiles "
          f"{base:.2f} us/layer, weight floor {floor_us:.2f} us/layer", flush=True)
    rows, best = [], dict(picked)
    for role in ROLES:
        n, k = chain.shapes[role]
        best_t = base
        for config in candidates(role, args.rows, k):
            t = chain.time_us_per_layer({**picked, role: config})
            rows.append([role, f"[{n}x{k}]", fmt(config), f"{t:.2f}", f"{t / base:.3f}"])
            print("row", *rows[-1], flush=True)
            if t < best_t:
                best_t, best[role] = t, config
    final = chain.time_us_per_layer(best)
    print("| role | shape | tile | us/layer | vs picked |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nbest of each: {', '.join(f'{r} {fmt(best[r])}' for r in ROLES)}: {final:.2f} us/layer "
          f"against picked {base:.2f} ({base / final:.3f}x), floor {floor_us:.2f}")


if __name__ == "__main__":
    main()
