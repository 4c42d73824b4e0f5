"""The fused all-reduce + residual add + RMSNorm kernel (pellucid.distributed.fused_all_reduce) under the Triton
interpreter, as one rank (of 2, and rank 2 of 4) with the others played by the test: their rows and flags are
written into this rank's buffer first, as their kernels would have, then this rank's kernel must write its rows
and raise its flags in every other rank's buffer, consume their flags in its own, and give the float32 sum of
every rank's row in rank order, rounded once, added to the residual and normalised, as torch computes them. Both halves of the buffer (consecutive calls), several
row counts, and a mixture of experts' rows (top_k per token, summed on the rank first). The two-GPU run is tests/gpu/test_all_reduce_gpu.py; this one runs in a subprocess, since
TRITON_INTERPRET must be set before triton is imported."""
from __future__ import annotations

import types

import pytest
import torch

from tests.gpu.check_support import interpret_file

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

HIDDEN, MAX_ROWS, MAX_HIDDEN = 96, 8, 128


def _rms_norm_reference(total: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = total.pow(2).mean(dim=-1, keepdim=True)
    return weight * (total * torch.rsqrt(variance + eps))


def run_cases(world: int, rank: int, device: str = "cpu") -> None:
    """This process's kernel as `rank` of `world`; the test plays every other rank (every buffer is in this
    process's memory: on one GPU the kernel runs as on several, without peers)."""
    from pellucid.distributed.fused_all_reduce import FLAG_BYTES, FusedAllReduceAddNorm

    flags_bytes, source_bytes, size = FusedAllReduceAddNorm.layout(world, MAX_ROWS, MAX_HIDDEN)
    buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(world)]
    tp = types.SimpleNamespace(rank=rank, size=world, device=torch.device(device))
    fused = FusedAllReduceAddNorm(tp, buffers[rank], [b.data_ptr() for b in buffers], MAX_ROWS, MAX_HIDDEN)
    generator = torch.Generator().manual_seed(world * 10 + rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)
    others = [r for r in range(world) if r != rank]

    def flags(owner: int, parity: int) -> torch.Tensor:      # [rows, source rank] of owner's buffer, one parity
        start = parity * flags_bytes
        return buffers[owner][start:start + flags_bytes].view(torch.int32).view(MAX_ROWS, world)

    def rows_in(owner: int, source: int, parity: int, rows: int) -> torch.Tensor:   # source's rows in owner's buffer
        start = 2 * flags_bytes + (parity * world + source) * source_bytes
        return buffers[owner][start:start + rows * HIDDEN * 4].view(torch.float32).view(rows, HIDDEN)

    for call, (rows, top_k) in enumerate(((1, 1), (3, 1), (MAX_ROWS, 1), (2, 1), (3, 4))):
        parity = call % 2
        residual = randn(rows, HIDDEN)
        theirs = {r: randn(rows, HIDDEN) for r in others}
        expert_rows = randn(rows * top_k, HIDDEN)        # top_k > 1: a mixture of experts' rows
        mine = expert_rows.view(rows, top_k, HIDDEN).sum(dim=1)
        weight = torch.rand(HIDDEN, generator=generator).to(device) + 0.5
        for r in others:
            rows_in(rank, r, parity, rows).copy_(theirs[r])      # rank r has written its rows into our buffer ...
            flags(rank, parity)[:rows, r] = 1                    # ... and raised its flags there
        stream, normed = fused(expert_rows, residual, weight, 1e-6, top_k)
        for r in others:
            assert bool((flags(r, parity)[:rows, rank] == 1).all()), "flags raised"
            torch.testing.assert_close(rows_in(r, rank, parity, rows), mine, rtol=1e-6, atol=1e-6)   # rows sent
            flags(r, parity).zero_()                             # rank r consumes them
        assert int(flags(rank, parity).abs().sum()) == 0, "the other ranks' flags were consumed"
        total = None
        for r in range(world):                                   # float32, in rank order
            part = mine if r == rank else theirs[r]
            total = part if total is None else total + part
        expected_stream = residual + total
        torch.testing.assert_close(stream, expected_stream, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(normed, _rms_norm_reference(expected_stream, weight, 1e-6), rtol=1e-5, atol=1e-5)
    assert fused.calls == 5 and FLAG_BYTES == 4
    fused.begin_forward()
    assert fused.calls == 0


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_all_reduce_kernel_under_interpreter() -> None:
    stdout = interpret_file(__file__, timeout=300)
    assert "fused all-reduce cases passed" in stdout


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_fused_all_reduce_kernel_on_one_gpu() -> None:
    """The compiled kernel, every rank's buffer on this GPU (the one-rank path of a GPU machine's CI)."""
    for world, rank in ((2, 0), (2, 1), (4, 2)):
        run_cases(world, rank, "cuda")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for world, rank in ((2, 0), (2, 1), (4, 2)):
        run_cases(world, rank)
    print("fused all-reduce cases passed")
