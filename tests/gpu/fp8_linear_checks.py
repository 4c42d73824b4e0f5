"""Checks of the FP8 projection kernels (pellucid.kernels.fp8_linear) against a brute-force float64 product of the
dequantized weight, runnable on a GPU or, on the CPU, under the Triton interpreter (TRITON_INTERPRET=1 set before
triton is imported).

`python tests/gpu/fp8_linear_checks.py DEVICE` runs them and exits non-zero on the first mismatch.
"""
from __future__ import annotations

import os
import sys

import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu.check_support import assert_close  # noqa: E402

# (N, K, block): whole-K skinny tiles with K a power of two and not (320: masked), a K loop (4,096), blocks of
# 128 x 128 as published checkpoints use, narrower ones, and K groups narrower than the skinny tile.
SHAPES = [(96, 256, (32, 64)), (64, 320, (16, 64)), (48, 4096, (16, 128)), (256, 512, (128, 128)),
          (40, 192, (8, 32))]
ROWS = [1, 2, 5, 33]


def random_fp8_weight(n: int, k: int, block: tuple[int, int], g: torch.Generator):
    from pellucid.models.fp8_experts import quantize
    codes, scale = quantize(torch.randn(n, k, generator=g) * k ** -0.5, block)
    return codes, scale * (1.0 + torch.rand(scale.shape, generator=g))     # not every block at the format's edge


def check_kernels(device: str) -> None:
    from pellucid.kernels.fp8_linear import (dequantize_weight, fp8_linear_cuda, fp8_skinny_linear, fp8_tiled_linear,
                                             pick_tiled_config)
    from pellucid.models.fp8_experts import dequantize
    g = torch.Generator().manual_seed(0)
    for n, k, block in SHAPES:
        codes, scale = random_fp8_weight(n, k, block, g)
        for dtype in (torch.float32, torch.bfloat16):
            weight = dequantize(codes, scale, dtype)
            w, s = codes.to(device), scale.to(device)
            dequantized = dequantize_weight(w, s, dtype).cpu()
            if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
                # the interpreter truncates to bfloat16 instead of rounding to nearest
                assert_close(dequantized, weight, dtype, f"dequantize {n}x{k} {block} {dtype}")
            else:
                assert torch.equal(dequantized, weight), f"dequantize {n}x{k} {block} {dtype}"
            bias = torch.randn(n, generator=g).to(dtype)
            for m in ROWS:
                x = torch.randn(m, k, generator=g).to(dtype)
                for with_bias in (False, True):
                    b = bias if with_bias else None
                    ref = x.double() @ weight.double().T + (0 if b is None else b.double())
                    what = f"M={m} N={n} K={k} block={block} {dtype} bias={with_bias}"
                    xd, bd = x.to(device), None if b is None else b.to(device)
                    outs = {"dispatch": fp8_linear_cuda(xd, w, s, bd), "tiled": fp8_tiled_linear(xd, w, s, bd)}
                    if m == 1:
                        outs["skinny"] = fp8_skinny_linear(xd, w, s, bd)
                    for kernel, out in outs.items():
                        assert_close(out.cpu(), ref.to(dtype), dtype, f"{kernel} {what}")
                if m == ROWS[-1]:      # the mid-size and long-prefill tiles on the same rows
                    for rows in (64, 512):
                        config = pick_tiled_config(rows, block[1])
                        out = fp8_tiled_linear(x.to(device), w, s, None, config)
                        assert_close(out.cpu(), (x.double() @ weight.double().T).to(dtype), dtype,
                                     f"tiled {config} {what}")
        print(f"fp8 linear {n}x{k} block {block}: ok", flush=True)


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    check_kernels(device)
    print("all FP8 linear checks passed")


if __name__ == "__main__":
    main()
