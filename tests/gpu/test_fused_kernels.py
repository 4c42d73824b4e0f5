"""Fused Triton kernels vs the plain torch layer code: on the GPU, and on the CPU under the Triton interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed")
def test_kernels_under_triton_interpreter():
    # The interpreter must be chosen before triton is imported, hence a fresh process.
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(HERE, "kernel_checks.py"), "cpu"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu():
    sys.path.insert(0, HERE)
    try:
        import kernel_checks
    finally:
        sys.path.remove(HERE)
    kernel_checks.run_all("cuda")
