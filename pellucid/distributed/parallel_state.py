"""This process's place in the tensor-parallel group, and the collectives the sharded layers use.

One engine is one tensor-parallel group: rank 0 lives in the engine-core process, ranks 1..N-1 in worker
processes (worker.py). Each process holds at most one group, so the group is process state, set once by
`init_tensor_parallel` (torch.distributed's own default group is process state too). Collectives run on
the device group (NCCL on CUDA, gloo on the CPU); start-up exchanges of Python values run on a gloo group
beside it, so they work whatever the device. With `all_reduce="symm_mem"` the small all-reduces take
torch's symmetric-memory one-shot kernel instead of NCCL (symm_mem_all_reduce.py).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from pellucid.config import ALL_REDUCES
from pellucid.distributed.symm_mem_all_reduce import SymmMemAllReduce, symm_mem_all_reduce
from pellucid.logger import get_logger

logger = get_logger(__name__)

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor (the older name still works there, with a warning).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallelStartupError(RuntimeError):
    """A rank could not start; the message names every rank that failed and why."""


@dataclass(frozen=True)
class Shard:
    """One rank's part of a dimension split over the tensor-parallel ranks: units [start, start + length)
    of `total` (attention heads, MLP columns, vocabulary rows). Every rank holds `length` units; a rank may
    hold units another holds too (KV heads replicated when there are fewer than ranks) and the last rank's
    part may run past `total` (a vocabulary padded to a multiple of the rank count)."""

    starts: tuple[int, ...]     # per rank
    length: int
    total: int
    rank: int

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def num_valid(self) -> int:
        """Units of this rank's part that exist (fewer than `length` only in a padded last part)."""
        return max(0, min(self.length, self.total - self.start))

    def owners(self) -> list[int]:
        """The ranks whose parts, in rank order, tile [0, total) once: the first holder of each part."""
        first: dict[int, int] = {}
        for rank, start in enumerate(self.starts):
            first.setdefault(start, rank)
        return [first[s] for s in sorted(first)]


def even_shard(total: int, size: int, rank: int, what: str) -> Shard:
    """`total` units split into `size` equal parts."""
    if total % size:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({size})")
    length = total // size
    return Shard(tuple(r * length for r in range(size)), length, total, rank)


def replicated_shard(total: int, size: int, rank: int, what: str) -> Shard:
    """`total` units over `size` ranks: split evenly when there are at least as many units as ranks, else
    one unit per rank, each held by size / total consecutive ranks (KV heads, as Megatron does)."""
    if total >= size:
        return even_shard(total, size, rank, what)
    if size % total:
        raise ValueError(f"tensor_parallel_size ({size}) must be a multiple of {what} ({total}) when it is larger")
    return Shard(tuple(r * total // size for r in range(size)), 1, total, rank)


def padded_shard(total: int, size: int, rank: int) -> Shard:
    """`total` units in `size` parts of ceil(total / size), the last ones padded (the vocabulary)."""
    length = -(-total // size)
    return Shard(tuple(r * length for r in range(size)), length, total, rank)


class TensorParallel:
    """This process's rank in the tensor-parallel group and the collectives on it."""

    def __init__(self, rank: int, size: int, device: torch.device, group: Any, cpu_group: Any) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.group = group            # the device group (NCCL on CUDA, gloo on the CPU)
        self.cpu_group = cpu_group    # gloo: Python values at start-up
        self.small_all_reduce: SymmMemAllReduce | None = None    # set by init_tensor_parallel (symm_mem)
        # The all-reduce fused with the residual add + RMSNorm after it (symm_mem): fused_all_reduce.py.
        self.fused_add_norm: Any = None    # FusedAllReduceAddNorm | None

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank in the engine-core process, the only one that reads the step's results."""
        return self.rank == 0

    # ---- collectives on device tensors (the step's; graph-capturable on NCCL) -------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: x summed in place (NCCL, gloo), or a new tensor (the symmetric-memory
        all-reduce, for the small messages it accepts). Use the returned tensor."""
        small = self.small_all_reduce
        if small is not None and small.accepts(x):
            return small(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size * rows, ...]: every rank's x stacked along dim 0, in rank order."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x as rank `src` holds it, on every rank, in place; returns x."""
        dist.broadcast(x, src=src, group=self.group)
        return x

    def gather_shards(self, x: torch.Tensor, shard: Shard, dim: int = 1) -> torch.Tensor:
        """The full tensor of which x is this rank's part along `dim` (units of `shard`): every rank's part,
        each unit once, in order, without padding."""
        parts = self.all_gather(x).view(self.size, *x.shape)
        owners = shard.owners()
        if owners != list(range(self.size)):
            parts = parts[owners]
        full = parts.movedim(0, dim).flatten(dim, dim + 1)     # [..., owners * local, ...]
        unit = x.shape[dim] // shard.length
        if full.shape[dim] != shard.total * unit:
            full = full.narrow(dim, 0, shard.total * unit)
        return full

    def local_part(self, full: torch.Tensor, shard: Shard, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full tensor along `dim` (the inverse of gather_shards), contiguous."""
        unit = full.shape[dim] // shard.total
        length = shard.num_valid * unit
        part = full.narrow(dim, shard.start * unit, length)
        if shard.num_valid < shard.length:
            pad = list(part.shape)
            pad[dim] = (shard.length - shard.num_valid) * unit
            part = torch.cat([part, part.new_zeros(pad)], dim=dim)
        return part.contiguous()

    def abort(self) -> None:
        """Make collectives waiting on a dead peer raise: NCCL's would wait for ever (gloo's raise by themselves)."""
        if dist.get_backend(self.group) != "nccl":
            return
        try:
            dist.distributed_c10d._abort_process_group(self.group)     # torch's communicator abort
        except Exception:          # an older torch without it: the engine process exits instead
            logger.debug("aborting the NCCL communicator failed", exc_info=True)

    # ---- host values (start-up) -----------------------------------------------------------------------
    def all_gather_object(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.cpu_group)
        return out

    def min_int(self, value: int) -> int:
        return int(min(self.all_gather_object(int(value))))

    def run_on_every_rank(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn` here while the other ranks run theirs, then agree: every rank raises
        TensorParallelStartupError naming the ranks that failed (and why) if any did. `fn` must not run
        collectives: a rank that failed before one would leave the others waiting in it."""
        try:
            result, error = fn(), None
        except Exception as exc:     # reported to every rank below, then raised
            logger.debug("tensor-parallel rank %d: %s failed", self.rank, what, exc_info=True)
            result, error = None, f"{type(exc).__name__}: {exc}"
        ranks_of: dict[str, list[int]] = {}
        for rank, err in enumerate(self.all_gather_object(error)):
            if err is not None:
                ranks_of.setdefault(err, []).append(rank)
        if ranks_of:
            failed = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {err}"
                               for err, r in ranks_of.items())
            raise TensorParallelStartupError(f"{what} failed on tensor-parallel {failed}")
        return result  # type: ignore[return-value]


_TP: TensorParallel | None = None


def get_tensor_parallel() -> TensorParallel | None:
    """This process's tensor-parallel rank, or None when the model is not sharded."""
    return _TP


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    return (0, 1) if _TP is None else (_TP.rank, _TP.size)


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str,
                         timeout_s: float = 600.0, all_reduce: str = "nccl") -> TensorParallel:
    """Join the group (torch.distributed's default group: NCCL on CUDA, gloo on the CPU) as `rank`.
    `all_reduce`: "nccl" (the group's own, gloo on the CPU) or "symm_mem" (symmetric memory for small
    messages where it can run, else the group's own, with the reason logged)."""
    if all_reduce not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {all_reduce!r}")
    global _TP
    if _TP is not None:
        raise RuntimeError("this process is already a tensor-parallel rank; one engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device          # eager NCCL communicator: the first collective is not captured
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _TP = TensorParallel(rank, size, device, dist.group.WORLD, cpu_group)
    # A first collective on the device group before any CUDA graph capture (NCCL sets up lazily otherwise).
    _TP.all_reduce(torch.zeros(1, device=device))
    if all_reduce == "symm_mem":
        _TP.small_all_reduce = symm_mem_all_reduce(_TP)
        if _TP.small_all_reduce is not None:       # symmetric memory works here
            from pellucid.distributed.fused_all_reduce import fused_all_reduce_add_norm    # imports Triton
            _TP.fused_add_norm = fused_all_reduce_add_norm(_TP)
    logger.info("tensor-parallel rank %d of %d on %s (%s, all-reduce %s, pid %d)", rank, size, device, backend,
                "symm_mem + nccl" if _TP.small_all_reduce is not None else backend, os.getpid())
    return _TP
