"""The fused all-reduce + residual add + RMSNorm kernel (pellucid.distributed.fused_all_reduce) under the Triton
interpreter, as rank 0 of 2 with rank 1 played by the test: rank 1's rows and flags are written into rank 0's
buffer first, as rank 1's kernel would have, then rank 0's kernel must write its rows and raise its flags in
rank 1's buffer, consume rank 1's flags in its own, and give the float32 sum of both ranks' rows, rounded once,
added to the residual and normalised, as torch computes them. Both halves of the buffer (consecutive calls), several
row counts, and a mixture of experts' rows (top_k per token, summed on the rank first). The two-GPU run is tests/gpu/test_all_reduce_gpu.py; this one runs in a subprocess, since
TRITON_INTERPRET must be set before triton is imported."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

HIDDEN, MAX_ROWS, MAX_HIDDEN = 96, 8, 128


def _rms_norm_reference(total: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = total.pow(2).mean(dim=-1, keepdim=True)
    return weight * (total * torch.rsqrt(variance + eps))


def run_cases() -> None:
    from pellucid.distributed.fused_all_reduce import FLAG_BYTES, FusedAllReduceAddNorm

    world = 2
    flags_bytes, source_bytes, size = FusedAllReduceAddNorm.layout(world, MAX_ROWS, MAX_HIDDEN)
    buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(world)]
    tp = types.SimpleNamespace(rank=0, size=world, device=torch.device("cpu"))
    fused = FusedAllReduceAddNorm(tp, buffers[0], [b.data_ptr() for b in buffers], MAX_ROWS, MAX_HIDDEN)
    generator = torch.Generator().manual_seed(0)

    def flags(rank: int, parity: int) -> torch.Tensor:      # [rows, source rank] of rank's buffer, one parity
        start = parity * flags_bytes
        return buffers[rank][start:start + flags_bytes].view(torch.int32).view(MAX_ROWS, world)

    def rows_in(rank: int, source: int, parity: int, rows: int) -> torch.Tensor:     # source's rows in rank's buffer
        start = 2 * flags_bytes + (parity * world + source) * source_bytes
        return buffers[rank][start:start + rows * HIDDEN * 4].view(torch.float32).view(rows, HIDDEN)

    for call, (rows, top_k) in enumerate(((1, 1), (3, 1), (MAX_ROWS, 1), (2, 1), (3, 4))):
        parity = call % 2
        theirs, residual = (torch.randn(rows, HIDDEN, generator=generator) for _ in range(2))
        expert_rows = torch.randn(rows * top_k, HIDDEN, generator=generator)    # top_k > 1: a mixture of experts'
        mine = expert_rows.view(rows, top_k, HIDDEN).sum(dim=1)
        weight = torch.rand(HIDDEN, generator=generator) + 0.5
        rows_in(0, 1, parity, rows).copy_(theirs)       # rank 1 has written its rows into rank 0's buffer ...
        flags(0, parity)[:rows, 1] = 1                  # ... and raised its flags in rank 0's buffer
        stream, normed = fused(expert_rows, residual, weight, 1e-6, top_k)
        assert torch.equal(flags(1, parity)[:rows, 0], torch.ones(rows, dtype=torch.int32)), "rank 0 raised its flags"
        assert int(flags(0, parity).abs().sum()) == 0, "rank 0 consumed rank 1's flags"
        torch.testing.assert_close(rows_in(1, 0, parity, rows), mine, rtol=1e-6, atol=1e-6)   # rank 0's rows, sent
        expected_stream = residual + (mine + theirs)
        torch.testing.assert_close(stream, expected_stream, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(normed, _rms_norm_reference(expected_stream, weight, 1e-6), rtol=1e-5, atol=1e-5)
        flags(1, parity).zero_()                        # rank 1 consumes rank 0's flags
    assert fused.calls == 5 and FLAG_BYTES == 4
    fused.begin_forward()
    assert fused.calls == 0
    print("fused all-reduce cases passed")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_all_reduce_kernel_under_interpreter() -> None:
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fused all-reduce cases passed" in proc.stdout


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_cases()
