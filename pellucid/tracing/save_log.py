"""A decode save stage's rows, step after step, in one growing device buffer.

While a decode batch stays the same (taps.py's _DecodeLayout), each of its save stages copies the same
(request, save) pairs' rows every step when every pair's position is selected (a save of every position,
or of every generated token). A `SaveLog` keeps those rows as [steps, pairs, *shape] blocks: a step writes
its rows with the one gather it needs anyway (into the next step slot, no fresh tensor), and each pair's
save list holds a single reference to the log instead of one record per step. When requests finish, their
rows are copied straight out of the log's blocks (`flat_blocks`, `row_index`) by the same copies that
assemble their other saves (plan.py), so assembling the saves does not walk a record per step and request.
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

    def flat_blocks(self, steps: int) -> list[torch.Tensor]:
        """The blocks holding the first `steps` steps, each viewed as [STEPS_PER_BLOCK * num_pairs, *shape]:
        row `row_index(...)` of their concatenation is a pair's row of a step."""
        return [block.flatten(0, 1) for block in self.blocks[:-(-steps // STEPS_PER_BLOCK)]]

    def row_index(self, pairs: np.ndarray, steps: int) -> np.ndarray:
        """[len(pairs), steps]: where each pair's row of each step lies in the concatenation of `flat_blocks`."""
        return np.arange(steps, dtype=np.int64) * self.num_pairs + pairs[:, None]

    def positions_of(self, pairs: np.ndarray, steps: int) -> np.ndarray:
        """[len(pairs), steps]: each pair's position at each of the first `steps` steps."""
        return np.array(self.positions[:steps]).T[pairs]
