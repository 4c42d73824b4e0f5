"""Per-step sampling inputs for the rows that produce a token, and what the sampler returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """One row per request that samples this step, in batch order. Tensors live on the logits' device.

    Flags (host booleans) let the sampler skip whole stages when no row needs them.
    """

    temperature: torch.Tensor            # [R] float32; 0 for greedy rows
    top_p: torch.Tensor                  # [R] float32; 1.0 = off
    top_k: torch.Tensor                  # [R] int64; 0 = off
    min_p: torch.Tensor                  # [R] float32; 0 = off
    presence_penalty: torch.Tensor       # [R] float32
    frequency_penalty: torch.Tensor      # [R] float32
    repetition_penalty: torch.Tensor     # [R] float32
    all_greedy: bool
    all_random: bool
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    no_penalties: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    prompt_token_ids: list[list[int]] | None = None   # per row, for repetition penalty (None if no penalties)
    output_token_ids: list[list[int]] | None = None   # per row, for all penalties (None if no penalties)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> ids masked (min_tokens)
    max_num_logprobs: int | None = None  # top-k alternatives to return (None: no logprobs)


@dataclass
class LogprobsTensors:
    """token_ids[:, 0] is the sampled (or actual prompt) token, columns 1.. the top-k alternatives."""

    token_ids: torch.Tensor   # [R, k + 1] int64
    logprobs: torch.Tensor    # [R, k + 1] float32
    ranks: torch.Tensor       # [R] int64: 1-based rank of column 0's token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [R] int64
    logprobs: LogprobsTensors | None = None
