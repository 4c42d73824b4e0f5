"""The engine's all-reduce choice on the CPU: `all_reduce="symm_mem"` on gloo falls back to gloo with the
reason logged, and sums as gloo does (tests/distributed/all_reduce_ranks.py; the GPU run of the same
script checks the symmetric-memory kernel itself: tests/gpu/test_all_reduce_gpu.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "all_reduce_ranks.py")


def test_symm_mem_on_gloo_falls_back_with_the_reason_logged():
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--all-reduce", "symm_mem"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all-reduce in use: gloo" in run.stdout
    assert "symm_mem was asked for, but the ranks are not CUDA ranks on NCCL" in run.stderr
    assert "rank 0: " in run.stdout and "rank 1: " in run.stdout


def test_all_reduce_option_is_validated():
    from pellucid.config import ParallelConfig
    from pellucid.distributed.parallel_state import init_tensor_parallel
    with pytest.raises(ValueError, match="all_reduce must be one of nccl, symm_mem"):
        ParallelConfig(all_reduce="custom").validate()
    with pytest.raises(ValueError, match="all_reduce must be one of nccl, symm_mem"):
        init_tensor_parallel(0, 1, torch.device("cpu"), "file:///nonexistent", all_reduce="custom")
