"""The symmetric-memory all-reduce on 2 GPUs equals NCCL's on random inputs of several sizes and dtypes
(the messages it does not take go to NCCL), eagerly and inside CUDA graphs, and the all-reduce fused with the
residual add + RMSNorm equals the sum, add and norm apart, bit for bit (tests/distributed/all_reduce_ranks.py).
Skipped without 2 CUDA devices."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed", "all_reduce_ranks.py")


def test_symm_mem_all_reduce_equals_nccl_on_two_gpus():
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--all-reduce", "symm_mem"],
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all-reduce in use: symm_mem" in run.stdout, run.stdout + run.stderr
    assert "fused add + norm: yes" in run.stdout, run.stdout + run.stderr
    assert "rank 0: " in run.stdout and "rank 1: " in run.stdout
