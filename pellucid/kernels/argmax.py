"""Row-wise argmax for greedy sampling: many programs per row, and the row's last program decodes the winner.

torch's argmax reduces each row of a [R, V] tensor within one thread block; at R = 1 that is one SM
streaming the whole vocabulary row (Llama-3.1-8B, 128,256 bf16 logits: 38 us on an H100 in
benchmarks/decode_timeline.py). Here each program takes BLOCK entries of a row, folds its best
(value, index) into the row's 64-bit accumulator with one atomic max (order-preserving value bits high,
2^31 - 1 - index low, so ties go to the lowest index), and counts itself done; the row's last program reads
the accumulator, writes the index and resets the accumulator and counter for the next call. Same answer
as torch.argmax: the first index of the largest value, with NaN counting as larger than everything.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel

BLOCK = 4096                  # entries per program: 32 per thread at 4 warps
_LOWEST = -(2 ** 63)
# Per (device, stream) accumulators [rows] int64 and counters [rows] int32, left reset by every call.
_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def ordered_int32(x):
    """float32 -> int32 in the same order (signed compare): flip the magnitude bits of negatives."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, best_ptr, count_ptr, num_cols, stride_row, programs_per_row,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_cols
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    key = tl.where(x != x, 0x7FFFFFFF, ordered_int32(x))     # NaN above +inf, as torch.argmax picks it
    packed = (key.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
    local = tl.max(tl.where(mask, packed, -9223372036854775807 - 1), axis=0)
    tl.atomic_max(best_ptr + row, local, sem="relaxed")
    finished = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if finished == programs_per_row - 1:
        final = tl.atomic_xchg(best_ptr + row, -9223372036854775807 - 1, sem="acq_rel")
        tl.store(count_ptr + row, 0)
        tl.store(out_ptr + row, 2147483647 - (final & 0xFFFFFFFF))


def _workspace(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda":
        key = (device.index if device.index is not None else torch.cuda.current_device(),
               torch.cuda.current_stream(device).cuda_stream)
    else:   # the Triton CPU interpreter (tests)
        key = (-1, 0)
    best, count = _workspaces.get(key, (None, None))
    if best is None or best.shape[0] < rows:
        size = max(rows, 256)
        best = torch.full((size,), _LOWEST, dtype=torch.int64, device=device)
        count = torch.zeros(size, dtype=torch.int32, device=device)
        _workspaces[key] = (best, count)
    return best, count


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=1) for a CUDA [R, V] float tensor (V < 2^31) contiguous along V; int64 [R].

    Calls on one stream share an accumulator per row, so they must not run concurrently with each other
    on that stream (they cannot: a stream runs its kernels in order)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] >= 2 ** 31 or not x.is_floating_point():
        raise ValueError(f"argmax_rows needs a [R, V] float tensor contiguous along V, got {tuple(x.shape)} "
                         f"{x.dtype} with strides {x.stride()}")
    rows, cols = x.shape
    if cols == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    best, count = _workspace(x.device, rows)
    programs = triton.cdiv(cols, BLOCK)
    _argmax_kernel[(rows, programs)](x, out, best, count, cols, x.stride(0), programs, BLOCK=BLOCK, num_warps=4,
                                     **pdl_launch_options(x))
    return out
