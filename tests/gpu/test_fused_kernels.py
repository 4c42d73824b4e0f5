"""Fused Triton kernels vs the plain torch layer code: on the GPU, and on the CPU under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.check_support import run_script_under_interpreter, triton_importable


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
def test_kernels_under_triton_interpreter():
    run_script_under_interpreter("kernel_checks.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu():
    from tests.gpu.kernel_checks import run_all
    run_all("cuda")
