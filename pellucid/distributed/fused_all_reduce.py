"""The decoder's all-reduce fused with the residual add and RMSNorm that follow it (`--all-reduce symm_mem`).

Why: at batch 1 a tensor-parallel decoder layer ends each half (attention, MLP) with a row-parallel
projection whose partial sums are all-reduced, then adds the sum to the residual stream and normalises it:
two launches, the all-reduce ~9 us of latency in a CUDA graph for an 8 KiB message (BENCHMARKS.md, issue 21),
64 times a step of an 8B model. Here one kernel does all of it, and being a PDL kernel (pellucid/kernels/
pdl.py), the next projection's programs load their weights while it waits on the other ranks.

One program per row (token):
1. it writes its row of this rank's partial sums into this rank's slot of every other rank's symmetric buffer
   (peer-mapped memory, torch.distributed._symmetric_memory; stores over NVLink need no reply, where reading
   a peer's copy would wait a round trip), then, after a block barrier, raises its flag in each of those
   buffers (a release at system scope, so the row lands before the flag);
2. it waits for every other rank's flag for its row in its own buffer and clears it (an acquire
   compare-and-swap), then reads the other ranks' rows from its own buffer, sums every rank's row in float32
   in rank order (so every rank gets the same bits), rounds the sum to the activation dtype as an
   all-reduce's output is, and finishes as pellucid.kernels.add_rms_norm does: residual + sum (rounded), its
   RMSNorm.

Consecutive calls alternate between two halves of the buffer and of the flags (`parity`). A rank can be at
most one call ahead of another: a call returns only once every rank has raised its flag in it, so a rank in
call k + 1 knows every other rank has finished call k - 1, whose half call k + 1 writes into. Every forward
starts at parity 0 (`begin_forward`), so a CUDA graph, captured with the parities of one forward, replays
them in step with the eager forwards; between two forwards the step's other collectives (the embedding's
all-reduce, the head's gather) keep the ranks together.

The fused path takes what the unfused one would compute, in one dtype: bfloat16 or float32 rows of at most
`max_rows` tokens and `max_hidden` columns; any other call keeps the all-reduce and the add + norm kernel.
A mixture of experts hands over its weighted expert rows unsummed (`top_k` rows per token, as to
pellucid.kernels.add_rms_norm.add_top_k_rms_norm): each rank sums its token's rows first, so its top-k sum
launch goes too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel
from pellucid.logger import get_logger

if TYPE_CHECKING:
    from pellucid.distributed.parallel_state import TensorParallel

logger = get_logger(__name__)

DTYPES = (torch.bfloat16, torch.float32)
DEFAULT_MAX_ROWS = 64
DEFAULT_MAX_HIDDEN = 16384        # Llama-3.1-405B's; the buffer is 2 x world x (64 x 16384 x 4) bytes plus flags
FLAG_BYTES = 4


@triton.jit
def _all_reduce_add_rms_norm_kernel(partial_ptr, residual_ptr, weight_ptr, residual_out_ptr, out_ptr, buffers_ptr,
                                    num_cols, eps, flags_offset, data_offset, source_bytes, row_bytes,
                                    RANK: tl.constexpr, WORLD: tl.constexpr, TOP_K: tl.constexpr,
                                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = partial_ptr.dtype.element_ty
    own_base = tl.load(buffers_ptr + RANK)
    wait_for_previous_kernel(PDL)
    if TOP_K == 1:
        mine = tl.load(partial_ptr + row * num_cols + cols, mask=mask, other=0.0)
    else:       # a mixture of experts' rows: this rank's sum of the token's k rows, as moe_gemm.sum_top_k's
        summed = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            summed += tl.load(partial_ptr + (row * TOP_K + j) * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        mine = summed.to(dtype)
    # This rank's row goes to its slot in every other rank's buffer (stores over NVLink need no reply).
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            slot = tl.load(buffers_ptr + peer) + data_offset + RANK * source_bytes + row * row_bytes
            tl.store(slot.to(tl.pointer_type(dtype)) + cols, mine, mask=mask)
    tl.debug_barrier()          # every thread's stores of the row precede the flags
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = (tl.load(buffers_ptr + peer) + flags_offset).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD + RANK, 1, sem="release", scope="sys")
    own_flags = (own_base + flags_offset).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(own_flags + row * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()          # the flags were seen before any thread reads the other ranks' rows
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):
        if rank == RANK:
            total += mine.to(tl.float32)
        else:
            slot = own_base + data_offset + rank * source_bytes + row * row_bytes
            total += tl.load(slot.to(tl.pointer_type(dtype)) + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    reduced = total.to(dtype).to(tl.float32)
    residual = tl.load(residual_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    stream = (reduced + residual).to(dtype)
    tl.store(residual_out_ptr + row * num_cols + cols, stream, mask=mask)
    stream = stream.to(tl.float32)
    variance = tl.sum(stream * stream, axis=0) / num_cols
    normed = (stream * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, (weight * normed).to(dtype), mask=mask)


class FusedAllReduceAddNorm:
    """(residual + all_reduce(partial), rms_norm(that)) in one kernel, through a rendezvoused buffer."""

    def __init__(self, tp: "TensorParallel", buffer: torch.Tensor, buffer_ptrs: list[int], max_rows: int,
                 max_hidden: int) -> None:
        self.rank, self.world = tp.rank, tp.size
        self.buffer = buffer                          # uint8, symmetric: flags, then two halves of rows
        self.buffer_ptrs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=tp.device)
        self.max_rows, self.max_hidden = max_rows, max_hidden
        self.calls = 0

    @staticmethod
    def layout(world: int, max_rows: int, max_hidden: int) -> tuple[int, int, int]:
        """(bytes of one parity's flags, bytes of one source rank's rows in one parity, the buffer's bytes).
        The buffer: both parities' flags [max_rows, world] (int32), then per parity and source rank its rows."""
        flags = max_rows * world * FLAG_BYTES
        source = max_rows * max_hidden * 4
        return flags, source, 2 * (flags + world * source)

    def begin_forward(self) -> None:
        self.calls = 0

    def accepts(self, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether it takes a batch of this residual stream [T, hidden] and norm weight."""
        return (residual.is_cuda and residual.dtype in DTYPES and residual.dtype == weight.dtype
                and residual.dim() == 2 and 0 < residual.shape[0] <= self.max_rows
                and residual.shape[1] <= self.max_hidden and residual.is_contiguous())

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`partial` [T, hidden], or with `top_k` > 1 [T * top_k, hidden]: token t's rows t * top_k ...,
        summed on this rank first (a mixture of experts' weighted expert rows)."""
        rows, hidden = residual.shape
        if partial.shape != (rows * top_k, hidden) or partial.dtype != residual.dtype or not partial.is_contiguous():
            raise ValueError(f"the fused all-reduce needs contiguous partial sums [{rows * top_k}, {hidden}] of "
                             f"{residual.dtype}, got {tuple(partial.shape)} {partial.dtype}")
        parity = self.calls & 1
        self.calls += 1
        flags, source, _ = self.layout(self.world, self.max_rows, self.max_hidden)
        residual_out, out = torch.empty_like(residual), torch.empty_like(residual)
        block = triton.next_power_of_2(hidden)
        _all_reduce_add_rms_norm_kernel[(rows,)](
            partial, residual, weight, residual_out, out, self.buffer_ptrs, hidden, eps,
            parity * flags, 2 * flags + parity * self.world * source, source, hidden * partial.element_size(),
            RANK=self.rank, WORLD=self.world, TOP_K=top_k, BLOCK=block, num_warps=min(16, max(1, block // 256)),
            **pdl_launch_options(partial))
        return residual_out, out


def fused_all_reduce_add_norm(tp: "TensorParallel", max_hidden: int = DEFAULT_MAX_HIDDEN,
                              max_rows: int = DEFAULT_MAX_ROWS) -> FusedAllReduceAddNorm | None:
    """The fused kernel for the group of `tp`, or None (logged, with the reason) where it cannot run: its
    buffer allocated and rendezvoused (outside any graph capture), its flags cleared, and checked once against
    NCCL and the unfused add + norm. Every rank calls it at start-up, together, and all get the same outcome."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    def agreed(local_reason: str | None) -> str | None:
        reasons = [r for r in tp.all_gather_object(local_reason) if r is not None]
        return reasons[0] if reasons else None

    fused, reason = None, None
    try:
        _, _, size = FusedAllReduceAddNorm.layout(tp.size, max_rows, max_hidden)
        buffer = symm_mem.empty(size, dtype=torch.uint8, device=tp.device)
        handle = symm_mem.rendezvous(buffer, tp.group.group_name)
        buffer.zero_()
        torch.cuda.synchronize(tp.device)
        fused = FusedAllReduceAddNorm(tp, buffer, list(handle.buffer_ptrs), max_rows, max_hidden)
    except Exception as exc:     # reported below, on every rank: all keep the unfused path together
        logger.debug("the fused all-reduce's rendezvous failed", exc_info=True)
        reason = f"its buffer could not be set up on a rank: {type(exc).__name__}: {exc}"
    reason = agreed(reason)
    if reason is None:
        dist.barrier(group=tp.cpu_group)        # every rank's flags are clear before any rank raises one
        reason = agreed(_self_check(tp, fused))
    if reason is not None:
        if tp.is_driver:
            logger.warning("tensor-parallel all-reduce + add + RMSNorm: not fused (%s)", reason)
        return None
    if tp.is_driver:
        logger.info("tensor-parallel all-reduce + add + RMSNorm fused in one kernel for up to %d tokens of up to %d "
                    "columns", max_rows, max_hidden)
    return fused


def _self_check(tp: "TensorParallel", fused: FusedAllReduceAddNorm | None) -> str | None:
    """Why the fused kernel cannot be used, or None: small integers (exact in any summation order) through both
    halves of the buffer give the residual stream of NCCL's sum plus the residual, and the unfused kernel's norm."""
    import torch.distributed as dist

    from pellucid.kernels.add_rms_norm import add_rms_norm

    assert fused is not None
    hidden = 1000
    generator = torch.Generator(device=tp.device).manual_seed(1234)
    try:
        for rows in (1, 3):
            partial = torch.randint(-8, 8, (rows, hidden), generator=generator, device=tp.device).float() + tp.rank
            residual = torch.randint(-8, 8, (rows, hidden), generator=generator, device=tp.device).float()
            weight = torch.rand(hidden, generator=generator, device=tp.device) + 0.5
            reduced = partial.clone()
            dist.all_reduce(reduced, group=tp.group)
            expected = add_rms_norm(reduced, residual, weight, 1e-6)
            got = fused(partial, residual, weight, 1e-6)
            if not torch.equal(got[0], expected[0]) or not torch.allclose(got[1], expected[1], atol=1e-5, rtol=1e-5):
                return "its first results differed from NCCL's all-reduce and the add + norm kernel"
    except Exception as exc:
        logger.debug("the fused all-reduce's self-check failed", exc_info=True)
        return f"its first call failed: {type(exc).__name__}: {exc}"
    finally:
        fused.begin_forward()
    return None
