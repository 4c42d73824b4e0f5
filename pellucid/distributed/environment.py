"""The settings a tensor-parallel rank takes from rank 0: its `PELLUCID_` environment variables.

They choose how a rank computes (which fused kernels, programmatic dependent launch, merged projections), and
ranks that computed their shards with other kernels would disagree without a word. A Ray actor is given rank
0's variables (ray_workers.py). Ranks a launcher started (torchrun) each have their own command's environment:
they check theirs against rank 0's at start-up, and a difference in one that changes the computation is a
start-up error.
"""
from __future__ import annotations

import os

PREFIX = "PELLUCID_"
# May differ between ranks: how a process logs, where rank 0 listens and how long ranks wait for each other.
PER_RANK = frozenset({"PELLUCID_LOG_LEVEL", "PELLUCID_TP_HOST", "PELLUCID_TP_STARTUP_TIMEOUT"})


def rank_environment() -> dict[str, str]:
    """This process's `PELLUCID_` environment variables."""
    return {name: value for name, value in os.environ.items() if name.startswith(PREFIX)}


def environment_differences(rank0: dict[str, str], mine: dict[str, str]) -> list[str]:
    """'NAME: rank 0 has A, this rank B' for each variable outside PER_RANK set differently (or on one side only)."""
    names = (set(rank0) | set(mine)) - PER_RANK
    return [f"{name}: rank 0 has {rank0.get(name, 'unset')!r}, this rank {mine.get(name, 'unset')!r}"
            for name in sorted(names) if rank0.get(name) != mine.get(name)]
