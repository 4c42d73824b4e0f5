"""N ranks check the engine's all-reduce (`TensorParallel.all_reduce`, with `--all-reduce` NCCL or symm_mem)
against the process group's own on random inputs of several sizes and dtypes, eagerly and, on CUDA,
inside CUDA graphs (a decode step's 64 back-to-back messages, and a chain whose every input is the last
output). Run by tests/distributed/test_all_reduce.py (gloo) and tests/gpu/test_all_reduce_gpu.py (NCCL):

    python tests/distributed/all_reduce_ranks.py --device cuda --all-reduce symm_mem

With symm_mem on CUDA it also checks the all-reduce fused with the residual add and RMSNorm
(pellucid.distributed.fused_all_reduce) against the float32 sum of every rank's message, rounded once, and
the add + norm kernel: bit for bit, eagerly and in a CUDA graph of 64 chained calls replayed on new inputs.

Prints "all-reduce in use: ..." and "fused add + norm: ..." (rank 0) and "rank R: N checks passed"; exits
non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Rows x columns: a decode message, odd sizes, one at the symm_mem limit and one past it (NCCL's).
SHAPES = [(1, 64), (1, 4096), (3, 1000), (8, 4096), (5,), (128, 4096), (200, 4096)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, msg=lambda m: f"{what}: {m}")


def _random(shape, dtype, device, generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device, dtype)


def _eager_checks(tp, device, generator) -> int:
    import torch.distributed as dist
    count = 0
    for dtype in DTYPES:
        for shape in SHAPES:
            for _ in range(2):
                x = _random(shape, dtype, device, generator)
                expected = x.clone()
                dist.all_reduce(expected, group=tp.group)
                _check(tp.all_reduce(x.clone()), expected, f"eager {dtype} {shape}")
                count += 1
    return count


def _graph_checks(tp, device, generator) -> int:
    """Graphs holding the engine's all-reduce, replayed on new inputs, against eager NCCL on the same."""
    import torch.distributed as dist
    decode = [torch.zeros(1, 4096, dtype=torch.bfloat16, device=device) for _ in range(64)]
    chain_in = torch.zeros(8, 4096, dtype=torch.float32, device=device)

    def step():
        outs = [tp.all_reduce(x.clone()) for x in decode]
        y = chain_in.clone()
        for _ in range(4):      # each all-reduce's input is the previous one's output
            y = tp.all_reduce(y * 0.5)
        return outs, y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                  # warm-up outside the capture, as torch asks
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, y = step()
    count = 0
    for replay in range(3):
        for x in decode:
            x.copy_(_random(x.shape, x.dtype, device, generator))
        chain_in.copy_(_random(chain_in.shape, chain_in.dtype, device, generator))
        graph.replay()
        for i, (x, out) in enumerate(zip(decode, outs)):
            expected = x.clone()
            dist.all_reduce(expected, group=tp.group)
            _check(out, expected, f"graph replay {replay}, decode message {i}")
        expected = chain_in.clone()
        for _ in range(4):
            expected = expected * 0.5
            dist.all_reduce(expected, group=tp.group)
        _check(y, expected, f"graph replay {replay}, chain")
        count += len(decode) + 1
    torch.cuda.synchronize()
    return count


def _fused_reference(tp, partial, residual, weight, eps, top_k=1):
    """The fused kernel's result computed apart: each rank's rows summed per token (top_k > 1: a mixture of
    experts' rows, TopKRows.summed), every rank's message gathered and summed in float32 in rank order, rounded
    once, then the add + norm kernel."""
    from pellucid.kernels.add_rms_norm import add_rms_norm
    from pellucid.models.layers import TopKRows
    if top_k > 1:
        partial = TopKRows(partial, top_k).summed()
    parts = tp.all_gather(partial).view(tp.size, *partial.shape).float()
    total = parts[0]
    for r in range(1, tp.size):
        total = total + parts[r]
    return add_rms_norm(total.to(partial.dtype), residual, weight, eps)


def _check_fused(got, expected, what: str) -> None:
    for name, a, b in zip(("residual", "normed"), got, expected):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differs, max |diff| {(a.float() - b.float()).abs().max().item()}")


def _fused_checks(tp, device, generator) -> int:
    fused = tp.fused_add_norm
    count = 0
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 17, 64):
            for hidden in (64, 1000, 4096, 5120):
                partial, residual = (_random((rows, hidden), dtype, device, generator) for _ in range(2))
                weight = (torch.rand(hidden, generator=generator) + 0.5).to(device, dtype)
                fused.begin_forward()
                for _ in range(3):      # both halves of the buffer, and back
                    expected = _fused_reference(tp, partial, residual, weight, 1e-6)
                    _check_fused(fused(partial, residual, weight, 1e-6), expected, f"fused {dtype} {rows}x{hidden}")
                    count += 1
    for top_k in (2, 8):        # a mixture of experts' weighted rows, summed on each rank first
        for rows in (1, 5):
            partial = _random((rows * top_k, 2048), torch.bfloat16, device, generator)
            residual = _random((rows, 2048), torch.bfloat16, device, generator)
            weight = (torch.rand(2048, generator=generator) + 0.5).to(device, torch.bfloat16)
            expected = _fused_reference(tp, partial, residual, weight, 1e-6, top_k)
            _check_fused(fused(partial, residual, weight, 1e-6, top_k), expected, f"fused top-{top_k} {rows} rows")
            count += 1
    # A CUDA graph of a decode step's chain: each call's residual is the previous call's.
    first = torch.zeros(2, 4096, dtype=torch.bfloat16, device=device)
    partials = [torch.zeros(2, 4096, dtype=torch.bfloat16, device=device) for _ in range(64)]
    weight = (torch.rand(4096, generator=generator) + 0.5).to(device, torch.bfloat16)

    def step():
        fused.begin_forward()
        residual, outs = first, []
        for x in partials:
            residual, normed = fused(x, residual, weight, 1e-5)
            outs.append((residual, normed))
        return outs

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for replay in range(3):
        first.copy_(_random(first.shape, first.dtype, device, generator))
        for x in partials:
            x.copy_(_random(x.shape, x.dtype, device, generator))
        graph.replay()
        residual = first
        for i, (x, got) in enumerate(zip(partials, outs)):
            expected = _fused_reference(tp, x, residual, weight, 1e-5)
            _check_fused(got, expected, f"graph replay {replay}, call {i}")
            residual = expected[0]
        count += len(partials)
    torch.cuda.synchronize()
    return count


def _rank(rank: int, size: int, device_type: str, init_method: str, all_reduce: str) -> None:
    import torch.distributed as dist

    from pellucid.distributed.parallel_state import init_tensor_parallel
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    tp = init_tensor_parallel(rank, size, device, init_method, timeout_s=120, all_reduce=all_reduce)
    if rank == 0:
        in_use = "symm_mem" if tp.small_all_reduce is not None else dist.get_backend(tp.group)
        print(f"all-reduce in use: {in_use}", flush=True)
        print(f"fused add + norm: {'yes' if tp.fused_add_norm is not None else 'no'}", flush=True)
    generator = torch.Generator().manual_seed(1000 + rank)
    count = _eager_checks(tp, device, generator)
    if device_type == "cuda":
        count += _graph_checks(tp, device, generator)
    if tp.fused_add_norm is not None:
        count += _fused_checks(tp, device, generator)
    print(f"rank {rank}: {count} checks passed", flush=True)
    tp.all_gather_object(None)      # every rank done before any leaves
    # Out without tearing the process groups down: NCCL's teardown after graph captures can hang (pytorch
    # issue 115388), and the process ends here anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--all-reduce", default="symm_mem")
    args = parser.parse_args()
    import torch.multiprocessing as mp
    store = os.path.join(tempfile.mkdtemp(prefix="pellucid-all-reduce-"), "store")
    mp.spawn(_rank, args=(args.size, args.device, f"file://{store}", args.all_reduce), nprocs=args.size, join=True)


if __name__ == "__main__":
    main()
