"""A decode save stage's rows, step after step, in one growing device buffer.

While a decode batch stays the same (taps.py's _DecodeLayout), each of its save stages copies the same
(request, save) pairs' rows every step when every pair's position is selected (a save of every position,
or of every generated token). A `SaveLog` keeps those rows as [steps, pairs, *shape] blocks: a step writes
its rows with the one gather it needs anyway (into the next step slot, no fresh tensor), and each pair's
save list holds a single reference to the log instead of one record per step. When requests finish, their
rows come out of the log with one gather for all of them (`rows_of`), already in position order, so
assembling the saves does not walk a record per step and request.
"""
from __future__ import annotations

import numpy as np
import torch

# Steps per block: a block is allocated once per this many steps (a fresh tensor per step costs an
# allocation each, and each of them a record to assemble later).
STEPS_PER_BLOCK = 32


class SaveLog:
    """Rows of `num_pairs` (request, save) pairs, one row per pair per step, with each row's position."""

    def __init__(self, num_pairs: int) -> None:
        self.num_pairs = num_pairs
        self.blocks: list[torch.Tensor] = []
        self.positions: list[np.ndarray] = []         # per step: each pair's position, [num_pairs]

    @property
    def num_steps(self) -> int:
        return len(self.positions)

    def write(self, source: torch.Tensor, index: torch.Tensor, positions: np.ndarray) -> None:
        """Record `source[index]` (one row per pair, in pair order) as the next step, at `positions`."""
        step = len(self.positions)
        block, slot = divmod(step, STEPS_PER_BLOCK)
        if block == len(self.blocks):
            self.blocks.append(torch.empty((STEPS_PER_BLOCK, self.num_pairs, *source.shape[1:]),
                                           dtype=source.dtype, device=source.device))
        torch.index_select(source, 0, index, out=self.blocks[block][slot])
        self.positions.append(positions)

    def rows_of(self, pairs: list[int]) -> tuple[torch.Tensor, np.ndarray]:
        """Every step's rows of `pairs`: a fresh [len(pairs) * steps, *shape] tensor (pair after pair, steps
        in order) and the matching [len(pairs), steps] positions."""
        steps = self.num_steps
        written = torch.cat(self.blocks) if len(self.blocks) > 1 else self.blocks[0]
        written = written[:steps]
        if pairs != list(range(self.num_pairs)):
            written = written.index_select(1, torch.as_tensor(pairs, dtype=torch.long).to(written.device))
        # A copy in (pair, step) order: each pair's rows become one contiguous run.
        rows = torch.empty((len(pairs), steps, *written.shape[2:]), dtype=written.dtype, device=written.device)
        rows.copy_(written.transpose(0, 1))
        positions = np.stack(self.positions, axis=1)[pairs]
        return rows.reshape(len(pairs) * steps, *written.shape[2:]), positions
