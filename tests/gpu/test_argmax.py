"""The multi-program argmax of greedy sampling (pellucid.kernels.argmax) against torch.argmax, exactly: random
rows with planted ties, NaN and infinities, row lengths around the program width, repeated calls (the
accumulators reset themselves); on the GPU, and on the CPU under the Triton interpreter.

`python tests/gpu/test_argmax.py DEVICE` runs the checks and exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

import pytest
import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu.check_support import run_script_under_interpreter, triton_importable


def _rows(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g)
    for r in range(rows):
        kind = int(torch.randint(0, 5, (1,), generator=g))
        picks = torch.randint(0, cols, (3,), generator=g)
        if kind == 1:       # the maximum tied at several places, possibly in different programs
            x[r, picks] = x[r].max() + 1
        elif kind == 2:
            x[r, picks[0]] = float("nan")
        elif kind == 3:
            x[r, picks[:2]] = float("inf")
            x[r, picks[2]] = float("-inf")
        elif kind == 4:
            x[r] = float("-inf")
    return x.to(dtype)


def run_all(device: str) -> None:
    from pellucid.kernels.argmax import BLOCK, argmax_rows
    g = torch.Generator().manual_seed(0)
    cpu = device == "cpu"
    sizes = [(1, 7), (3, BLOCK), (2, BLOCK + 1), (5, 3 * BLOCK - 5)] if cpu else \
        [(1, 151936), (1, 128256), (8, 32000), (64, 1000), (300, BLOCK + 1), (2, 7)]
    for dtype in (torch.bfloat16, torch.float32):
        for rows, cols in sizes:
            for _ in range(2):      # a second call must find the accumulators reset
                x = _rows(rows, cols, dtype, g).to(device)
                got = argmax_rows(x)
                assert torch.equal(got, x.argmax(dim=1)), f"{dtype} [{rows}, {cols}]: {got} vs {x.argmax(dim=1)}"
    x = _rows(4, 50, torch.float32, g).to(device)[:, 10:]      # a view: rows strided, columns contiguous
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))


def test_refusals():
    from pellucid.kernels.argmax import argmax_rows
    for bad in (torch.randn(4, 6).t(), torch.randn(5), torch.arange(6).view(2, 3), torch.randn(2, 0)):
        with pytest.raises(ValueError):
            argmax_rows(bad)


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel (test_argmax_on_gpu)")
def test_argmax_under_triton_interpreter():
    run_script_under_interpreter("test_argmax.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_argmax_on_gpu():
    run_all("cuda")


if __name__ == "__main__":
    run_all(sys.argv[1])
