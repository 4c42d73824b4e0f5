"""Shared by the kernel check scripts and the tests that run them: the error measure, and running a
check script under the Triton interpreter in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    # bf16: one rounding step is ~4e-3 relative; the Triton interpreter truncates instead of rounding to nearest.
    limit = 1e-5 if dtype == torch.float32 else (2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 4e-3)
    assert err < limit, f"{what}: relative error {err:.3g} >= {limit}"


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def run_script_under_interpreter(script: str) -> None:
    """Run tests/gpu/`script` on the CPU under the Triton interpreter; it exits non-zero on a mismatch.
    The interpreter must be chosen before triton is imported, hence a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(HERE, script), "cpu"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
