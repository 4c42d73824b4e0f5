"""Checkpoint layouts of mixture-of-experts weights, and where each tensor goes in the model.

The model holds every layer's experts as two 3D parameters, as transformers 5 does in memory:
`mlp.experts.gate_up_proj` [E, 2 * I, hidden] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, hidden, I]. Checkpoints come in two layouts, both accepted (a checkpoint may
mix them across layers, never within one):

- per-expert tensors, as published checkpoints have them and as transformers 5's `save_pretrained`
  writes them: `mlp.experts.{e}.gate_proj.weight` [I, hidden], `up_proj`, `down_proj` (Qwen); Mixtral's
  `block_sparse_moe.experts.{e}.w1.weight` (gate), `w3` (up), `w2` (down), under `block_sparse_moe`
  instead of `mlp`;
- the fused 3D tensors under the parameters' own names (what transformers 5 holds in memory).

Anything else is refused by the loader, naming the tensor: an unknown per-expert projection here, an
unexpected name or a wrong shape (e.g. a transposed fused tensor) in pellucid.models.loader.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pellucid.distributed.parallel_state import Shard
from pellucid.models.fp8_experts import SCALE_SUFFIX, scale_shard
from pellucid.models.parallel_layers import RankSlice, shard_ranges

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight"
                         r"(?P<scale>_scale_inv)?$")


@dataclass(frozen=True)
class ExpertCheckpointNames:
    """One architecture's per-expert tensor names."""

    block_aliases: tuple[str, ...] = ()     # other names of the `mlp` module in checkpoints
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def target(self, name: str, intermediate_size: int, shard: Shard | None = None,
               fp8_block: tuple[int, int] | None = None
               ) -> tuple[str, tuple[Any, ...]] | tuple[str, tuple[Any, ...], RankSlice] | None:
        """(parameter name, index into it) for checkpoint tensor `name`; None when it is the parameter of
        the same name. ValueError for a per-expert tensor of an unknown projection. Under tensor parallelism
        (`shard` of the intermediate size) a per-expert tensor also names the part of it this rank reads.
        `fp8_block`: the layer's experts stay in FP8 (fp8_experts.py), so a per-expert weight's block scales
        (`...weight_scale_inv`) go to their part of the fused scale parameter; without it they are left to the
        loader's dequantizer (None)."""
        renamed = name
        for alias in self.block_aliases:
            renamed = renamed.replace(f".{alias}.", ".mlp.")
        match = _PER_EXPERT.match(renamed)
        if match is None:
            return None if renamed == name else (renamed, ())
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        scale = match["scale"] is not None
        if scale and fp8_block is None:
            return None             # read by the loader's dequantizer with its weight
        # Block scales go where their weight goes, counted in blocks: gate/up rows of bn, down columns of bk.
        suffix, (row_unit, column_unit) = (SCALE_SUFFIX, fp8_block) if scale else ("", (1, 1))
        if proj in (self.gate, self.up):
            local = (intermediate_size if shard is None else shard.length) // row_unit
            first = 0 if proj == self.gate else local
            return (f"{prefix}.gate_up_proj{suffix}", (expert, slice(first, first + local)),
                    *_rank_part(0, shard, row_unit, intermediate_size))
        if proj == self.down:
            return f"{prefix}.down_proj{suffix}", (expert,), *_rank_part(1, shard, column_unit, intermediate_size)
        raise ValueError(f"checkpoint tensor {name!r}: unknown expert projection {proj!r}; this architecture's "
                         f"per-expert tensors are {self.gate}, {self.up} and {self.down} (or the fused "
                         f"experts.gate_up_proj / experts.down_proj)")


def _rank_part(dim: int, shard: Shard | None, unit: int, intermediate_size: int) -> tuple[RankSlice, ...]:
    """The rank's part of a per-expert tensor whose `dim` spans the intermediate size in `unit`-element blocks:
    () without tensor parallelism."""
    if shard is None:
        return ()
    units = shard if unit == 1 else scale_shard(shard, unit)
    return ((dim, shard_ranges(units, intermediate_size // unit)),)
