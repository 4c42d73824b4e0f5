"""A low-latency all-reduce for the small messages of tensor-parallel decode: torch's symmetric-memory
one-shot all-reduce, with NCCL keeping every other message (`--all-reduce symm_mem`).

Why: a batch-1 decode step of an 8B model at TP=2 all-reduces 64 messages of 8 KiB, and NCCL spends
~15-20 us on each whatever its size (its protocol, not the bytes): about 1 ms of a 3.9 ms step. The
one-shot kernel of `torch.distributed._symmetric_memory` copies this rank's message into a buffer that
every rank has mapped (CUDA peer-to-peer, over NVLink), meets the other ranks on signal pads in device
memory, then reads and sums every rank's copy: one kernel and no host work, so a CUDA graph captures it
like any kernel.

What it needs, checked at start-up; where one check fails every rank keeps NCCL and rank 0 logs why (the
ranks agree on the outcome: they must run the same collectives):
- CUDA ranks on one machine whose GPUs reach each other peer-to-peer;
- a torch with `torch.ops.symm_mem.one_shot_all_reduce_copy_out` (torch >= 2.8; the H100 machines have 2.11);
- the buffer allocated and rendezvoused now, outside any graph capture: the rendezvous exchanges handles
  through the store, and every later use finds it cached, which is what makes the op capturable;
- a first all-reduce, run eagerly, equal to NCCL's.

Per message it takes float32 and bfloat16 (the kernel's types), contiguous, 16-byte aligned, of at most
`max_bytes` (one-shot reads every rank's whole message, so it wins only while messages are small); any
other message goes to NCCL. The choice depends on the message's dtype and shape only, the same on every
rank. NVLink multicast is never used: only the peer-to-peer one-shot kernel.
"""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pellucid.logger import get_logger

if TYPE_CHECKING:
    from pellucid.distributed.parallel_state import TensorParallel

logger = get_logger(__name__)

# Messages above this go to NCCL. 1 MiB covers decode up to batch 128 of a 4096-wide bf16 model; the
# crossover against NCCL is measured by `benchmarks/tp_bench.py allreduce` (BENCHMARKS.md).
DEFAULT_MAX_BYTES = 1 << 20
DTYPES = (torch.float32, torch.bfloat16)
ALIGN = 16    # the kernel's widest vector: input, output and buffer must share their alignment
OP_NAME = "one_shot_all_reduce_copy_out"


class SymmMemAllReduce:
    """The one-shot all-reduce of messages that `accepts` takes, through a rendezvoused buffer."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer            # uint8 [max_bytes], symmetric: every rank maps every rank's
        self.group_name = group_name
        self.max_bytes = max_bytes
        self._op = getattr(torch.ops.symm_mem, OP_NAME)

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes and nbytes % ALIGN == 0
                and (x.storage_offset() * x.element_size()) % ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, as a new tensor (x is left as it is)."""
        nbytes = x.numel() * x.element_size()
        staging = self.buffer[:nbytes].view(x.dtype).view(x.shape)    # the kernel copies x in here first
        return self._op(staging, x, "sum", self.group_name, torch.empty_like(x))


def symm_mem_all_reduce(tp: "TensorParallel", max_bytes: int = DEFAULT_MAX_BYTES) -> SymmMemAllReduce | None:
    """The symmetric-memory all-reduce for the group of `tp`, or None (logged, with the reason) where it
    cannot run. Every rank calls it at start-up, together."""
    def agreed(local_reason: str | None) -> str | None:
        reasons = [r for r in tp.all_gather_object(local_reason) if r is not None]
        return reasons[0] if reasons else None

    # Where every rank is, gathered first: the checks below then run no collective, whatever they find.
    places = tp.all_gather_object((socket.gethostname(), tp.device.index, os.environ.get("CUDA_VISIBLE_DEVICES")))
    reason = agreed(_local_obstacle(tp, places))
    impl = None
    if reason is None:
        try:
            impl = _rendezvous(tp, max_bytes)
        except Exception as exc:     # reported below, on every rank: all fall back together
            logger.debug("symmetric-memory rendezvous failed", exc_info=True)
            reason = f"the rendezvous failed on a rank: {type(exc).__name__}: {exc}"
        reason = agreed(reason)
    if reason is None:
        reason = agreed(_self_check(tp, impl))
    if reason is not None:
        if tp.is_driver:
            logger.warning("tensor-parallel all-reduce: %s for every message (symm_mem was asked for, but %s)",
                           dist.get_backend(tp.group), reason)
        return None
    if tp.is_driver:
        logger.info("tensor-parallel all-reduce: symm_mem one-shot for float32/bfloat16 messages of up to %d "
                    "bytes, NCCL for the others", max_bytes)
    return impl


def _local_obstacle(tp: "TensorParallel", places: list[tuple[str, int | None, str | None]]) -> str | None:
    """Why this rank cannot use symmetric memory, or None. `places`: every rank's (host, GPU index,
    CUDA_VISIBLE_DEVICES)."""
    if tp.device.type != "cuda" or dist.get_backend(tp.group) != "nccl":
        return f"the ranks are not CUDA ranks on NCCL ({tp.device.type}, {dist.get_backend(tp.group)})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({exc})"
    if not hasattr(torch.ops.symm_mem, OP_NAME):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{OP_NAME}"
    if len({host for host, _, _ in places}) > 1:
        return "the ranks are on several machines (peer-to-peer needs one)"
    indices = [index for _, index, _ in places]
    if len({visible for _, _, visible in places}) > 1 or len(set(indices)) < len(indices):
        return "the ranks see different sets of GPUs (a GPU per process, as Ray actors do), so peer access " \
               "between them cannot be checked"
    mine = tp.device.index
    for other in indices:
        if other != mine and not torch.cuda.can_device_access_peer(mine, other):
            return f"GPU {mine} cannot access GPU {other} peer-to-peer"
    return None


def _rendezvous(tp: "TensorParallel", max_bytes: int) -> SymmMemAllReduce:
    import torch.distributed._symmetric_memory as symm_mem
    from torch.torch_version import TorchVersion
    # Only the peer-to-peer kernel runs: multicast objects would be mapped for nothing (a user who set the
    # variable keeps their value).
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    group_name = tp.group.group_name
    if TorchVersion(torch.__version__) < "2.11":
        symm_mem.enable_symm_mem_for_group(group_name)    # required before 2.11, deprecated since
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=tp.device)
    symm_mem.rendezvous(buffer, group_name)
    return SymmMemAllReduce(buffer, group_name, max_bytes)


def _self_check(tp: "TensorParallel", impl: SymmMemAllReduce | None) -> str | None:
    """A first (eager) all-reduce, against NCCL's: small integers, so any summation order is exact."""
    assert impl is not None
    x = (torch.arange(1024, device=tp.device) % 61 + tp.rank).to(torch.float32)
    expected = x.clone()
    dist.all_reduce(expected, group=tp.group)
    try:
        got = impl(x)
        same = torch.equal(got, expected)
    except Exception as exc:      # agreed on by every rank, which then all keep NCCL
        logger.debug("symmetric-memory self-check failed", exc_info=True)
        return f"its first all-reduce failed: {type(exc).__name__}: {exc}"
    return None if same else "its first all-reduce differed from NCCL's"
