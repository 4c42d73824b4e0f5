"""Megatron-style sharded layers (tensor parallelism), each keeping the HuggingFace module it replaces.

- Column-parallel (q/k/v, gate/up): a plain `Linear` holding this rank's rows of the weight; its output is
  this rank's heads or columns.
- Row-parallel (o_proj, down_proj): `RowParallelLinear` holds this rank's columns, sums the ranks' partial
  products with an all-reduce and adds the bias once, so its output is the full value HuggingFace computes.
- The vocabulary (`VocabParallelEmbedding`, the LM head weight): each rank holds a contiguous range of rows,
  the vocabulary padded to a multiple of the rank count.
- Mixture-of-experts layers (moe.py): every rank holds every expert's columns of its share of the expert
  intermediate size (gate/up rows, down columns), and the experts' output is all-reduced; the router is
  whole on every rank.

Every sharded module records what it holds, for the two consumers that need the full picture:
- `tp_weights` {parameter name: (dim, Shard) or (dim, Shard, blocks)}: the loader reads only this rank's
  slice of the checkpoint tensor (models/loader.py); `blocks` equal blocks of dim are sharded alike (the
  experts' fused gate/up tensor);
- `tp_sites` {"input" | "output": Shard of dim 1}: a trace of that site sees the full tensor, gathered
  from the ranks, and an edit of it lands back on each rank's part (tracing/taps.py `install_hooks`).

At tensor_parallel_size 1 the builders below return the plain modules.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.distributed.parallel_state import (Shard, TensorParallel, even_shard, get_tensor_parallel, padded_shard,
                                                 replicated_shard)
from pellucid.models.layers import Embedding, Linear, linear


def _tp() -> TensorParallel | None:
    return get_tensor_parallel()


def mark_sites(module: nn.Module, shard: Shard, *points: str) -> nn.Module:
    """Record that `module`'s values at `points` hold this rank's part (dim 1) of `shard`."""
    sites = dict(getattr(module, "tp_sites", {}))
    sites.update({point: shard for point in points})
    module.tp_sites = sites
    return module


def column_linear(in_features: int, out_units: int, unit: int, bias: bool, dtype: torch.dtype,
                  device: torch.device | str, what: str, replicate: bool = False) -> Linear:
    """A Linear computing out_units * unit outputs, or this rank's units of them (heads of `unit` rows,
    or columns with unit 1). `replicate`: fewer units than ranks share units (KV heads)."""
    tp = _tp()
    if tp is None:
        return Linear(in_features, out_units * unit, bias=bias, dtype=dtype, device=device)
    make = replicated_shard if replicate else even_shard
    shard = make(out_units, tp.size, tp.rank, what)
    layer = Linear(in_features, shard.length * unit, bias=bias, dtype=dtype, device=device)
    layer.tp_weights = {"weight": (0, shard), **({"bias": (0, shard)} if bias else {})}
    return mark_sites(layer, shard, "output")


def unit_shard(units: int, what: str, replicate: bool = False) -> Shard | None:
    """This rank's part of `units` (heads, columns), or None without tensor parallelism."""
    tp = _tp()
    if tp is None:
        return None
    return (replicated_shard if replicate else even_shard)(units, tp.size, tp.rank, what)


class RowParallelLinear(Linear):
    """`Linear(in_units * unit, out)` of which this rank holds input units `shard` (its columns of the
    weight): the partial products of the ranks are summed by an all-reduce, then the bias is added once."""

    def __init__(self, shard: Shard, unit: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(shard.length * unit, out_features, bias=bias, dtype=dtype, device=device)
        self.tp_weights = {"weight": (1, shard)}     # the bias is whole on every rank
        mark_sites(self, shard, "input")

    @property
    def local_bias(self) -> torch.Tensor | None:
        return None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        tp = _tp()
        assert tp is not None
        out = tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(linear(x, self.weight, None, self.weight_scale))


def fused_reduction_applies(residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether a layer's all-reduce, the residual add and the RMSNorm after it can run as one kernel
    (pellucid.distributed.fused_all_reduce): under tensor parallelism with that kernel set up, for a batch it
    takes. The caller checks that its partial sums need only the all-reduce (a row-parallel projection without
    bias: `reduces_partial_sums`) and that nothing observes what it skips."""
    from pellucid.kernels import fused_kernels_enabled

    tp = _tp()
    fused = tp.fused_add_norm if tp is not None else None
    return (fused is not None and fused_kernels_enabled(residual, "tp_all_reduce_add_rms_norm")
            and fused.accepts(residual, norm_weight))


def reduces_partial_sums(projection: nn.Module) -> bool:
    """A row-parallel projection without bias: its output is the ranks' all-reduced partial sums, nothing more."""
    return isinstance(projection, RowParallelLinear) and projection.bias is None


def all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + the ranks' sum of `partial`, its RMSNorm) from one kernel; only where
    fused_reduction_applies. With `top_k` > 1, `partial` holds each token's top_k rows, summed first."""
    tp = _tp()
    assert tp is not None and tp.fused_add_norm is not None
    return tp.fused_add_norm(partial.contiguous(), residual, norm_weight, eps, top_k)


def begin_forward() -> None:
    """A forward starts: the fused all-reduce's calls count from the first again (fused_all_reduce.py)."""
    tp = _tp()
    if tp is not None and tp.fused_add_norm is not None:
        tp.fused_add_norm.begin_forward()


def row_linear(in_units: int, unit: int, out_features: int, bias: bool, dtype: torch.dtype,
               device: torch.device | str, what: str) -> Linear:
    """Linear(in_units * unit, out_features), row-parallel under tensor parallelism."""
    shard = unit_shard(in_units, what)
    if shard is None:
        return Linear(in_units * unit, out_features, bias=bias, dtype=dtype, device=device)
    return RowParallelLinear(shard, unit, out_features, bias, dtype, device)


class VocabParallelEmbedding(Embedding):
    """nn.Embedding of which this rank holds vocabulary rows `shard`: rows of other ranks' tokens are
    zero here, and an all-reduce assembles every token's row."""

    def __init__(self, shard: Shard, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(shard.length, hidden_size, dtype=dtype, device=device)
        self.vocab_shard = shard
        self.tp_weights = {"weight": (0, shard)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = _tp()
        assert tp is not None
        local = input_ids - self.vocab_shard.start
        outside = (local < 0) | (local >= self.vocab_shard.num_valid)
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


def vocab_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> Embedding:
    tp = _tp()
    if tp is None:
        return Embedding(vocab_size, hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(padded_shard(vocab_size, tp.size, tp.rank), hidden_size, dtype, device)


def lm_head_linear(hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    """The `lm_head` holder of the weight (never called as a module: pellucid.heads computes the logits);
    under tensor parallelism its rows are this rank's vocabulary (`vocab_shard`)."""
    tp = _tp()
    if tp is None:
        return nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device)
    shard = padded_shard(vocab_size, tp.size, tp.rank)
    head = nn.Linear(hidden_size, shard.length, bias=False, dtype=dtype, device=device)
    head.vocab_shard = shard
    head.tp_weights = {"weight": (0, shard)}
    return head


RankSlice = tuple[int, list[tuple[int, int]]]     # (dim, [(start, stop), ...]): the ranges, concatenated


def checkpoint_slice(module: nn.Module, param_name: str, full_shape: tuple[int, ...]) -> RankSlice | None:
    """The part of the checkpoint tensor of `module.<param_name>` (of shape `full_shape`) this rank holds:
    (dim, element ranges along it, concatenated); None when the rank holds all of it. A spec
    `(dim, shard, blocks)` splits dim into `blocks` equal blocks sharded alike (a fused gate/up tensor)."""
    spec: Any = getattr(module, "tp_weights", {}).get(param_name)
    if spec is None:
        return None
    dim, shard, blocks = (*spec, 1) if len(spec) == 2 else spec
    return dim, shard_ranges(shard, full_shape[dim], blocks)


def shard_ranges(shard: Shard, size: int, blocks: int = 1) -> list[tuple[int, int]]:
    """Element ranges of `shard` in a dimension of `size` made of `blocks` equal blocks of shard.total units."""
    unit = size // (shard.total * blocks)
    if unit * shard.total * blocks != size:
        raise ValueError(f"a checkpoint dimension of size {size} does not split into {blocks} x {shard.total} units")
    block = shard.total * unit
    return [(b * block + shard.start * unit, b * block + (shard.start + shard.num_valid) * unit) for b in range(blocks)]
