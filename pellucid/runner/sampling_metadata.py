"""Per-step sampling inputs for the rows that produce a token, and what the sampler returns."""
from __future__ import annotations

import dataclasses
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
    # row -> this step's seed of a seeded random row, drawn once per step from the request's generator. Every
    # draw the row makes this step comes from generators seeded with it (sampler.step_generator), so the
    # draw depends on the request's seed, its step and its distribution only, never on the batch around it.
    seeds: dict[int, int] = field(default_factory=dict)
    prompt_token_ids: list[list[int]] | None = None   # per row, for repetition penalty (None if no penalties)
    output_token_ids: list[list[int]] | None = None   # per row, for all penalties (None if no penalties)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> ids masked (min_tokens)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token id: added to its logit}
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> the only ids it may sample
    # Structured outputs: the rows held to a grammar, and row i of `grammar_bitmask` [len, words] int32 (on the
    # logits' device) allows what grammar_rows[i] may sample (bit t % 32 of word t // 32 for token t).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # top-k alternatives to return (None: no logprobs)
    # Rows whose result needs every logit of the vocabulary (they ask for logprobs, carry a penalty or have their
    # logits edited: banned tokens, a bias, an allowed set, a grammar), for heads that may serve the other rows
    # approximately. None (metadata built by hand): every row when the batch has logprobs or penalties, the rows
    # with edited logits otherwise.
    full_vocab_rows: list[int] | None = None
    # Device tensors the sampler built from the host fields above, kept for the steps that reuse this metadata
    # (a steady decode batch); a subset starts empty.
    device_tensors: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict, init=False, repr=False,
                                                                 compare=False)

    @property
    def edits_logits(self) -> bool:
        """Whether some row's logits change before sampling: banned tokens, a logit bias, an allowed set or a
        grammar."""
        return bool(self.banned_token_ids or self.logit_bias or self.allowed_token_ids or self.grammar_rows)

    def subset(self, rows: list[int], index: torch.Tensor) -> SamplingMetadata:
        """The metadata of `rows` (ascending; `index` the same on the device), renumbered 0..len-1. The host
        flags of the whole batch stay true for a subset, if sometimes more cautious than needed."""
        renumber = {old: new for new, old in enumerate(rows)}
        pick = (lambda lists: None if lists is None else [lists[r] for r in rows])
        kept = [i for i, r in enumerate(self.grammar_rows) if r in renumber]
        bitmask = self.grammar_bitmask if kept else None
        if bitmask is not None and len(kept) < len(self.grammar_rows):
            bitmask = bitmask.index_select(0, torch.tensor(kept, dtype=torch.int64).to(bitmask.device,
                                                                                          non_blocking=True))
        return dataclasses.replace(
            self,
            temperature=self.temperature[index], top_p=self.top_p[index], top_k=self.top_k[index],
            min_p=self.min_p[index], presence_penalty=self.presence_penalty[index],
            frequency_penalty=self.frequency_penalty[index], repetition_penalty=self.repetition_penalty[index],
            seeds={renumber[r]: s for r, s in self.seeds.items() if r in renumber},
            prompt_token_ids=pick(self.prompt_token_ids), output_token_ids=pick(self.output_token_ids),
            banned_token_ids={renumber[r]: ids for r, ids in self.banned_token_ids.items() if r in renumber},
            logit_bias={renumber[r]: bias for r, bias in self.logit_bias.items() if r in renumber},
            allowed_token_ids={renumber[r]: ids for r, ids in self.allowed_token_ids.items() if r in renumber},
            grammar_rows=[renumber[self.grammar_rows[i]] for i in kept], grammar_bitmask=bitmask,
            full_vocab_rows=None if self.full_vocab_rows is None else
            [renumber[r] for r in self.full_vocab_rows if r in renumber])


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
    # Ids a head samples beside each row's token ([R, k]; Qwen3-Omni's talker: the frame's codes), read by
    # the model's stage outputs (pellucid.pipeline), not by the engine.
    extra_token_ids: torch.Tensor | None = None


def merge_sampler_outputs(num_rows: int, parts: list[tuple[torch.Tensor, SamplerOutput]]) -> SamplerOutput:
    """One output for R rows from outputs of disjoint row subsets, each given with its rows' device index.
    Logprobs, when some part has them, are as wide as the widest part's; rows of parts without logprobs (or
    with fewer alternatives) are padded with token id -1 and logprob -inf (never read: those rows did not ask)."""
    device = parts[0][1].sampled_token_ids.device
    sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
    for index, out in parts:
        sampled[index] = out.sampled_token_ids.to(torch.int64)
    with_logprobs = [(index, out.logprobs) for index, out in parts if out.logprobs is not None]
    if not with_logprobs:
        return SamplerOutput(sampled_token_ids=sampled)
    width = max(lp.token_ids.shape[1] for _, lp in with_logprobs)
    merged = LogprobsTensors(token_ids=torch.full((num_rows, width), -1, dtype=torch.int64, device=device),
                             logprobs=torch.full((num_rows, width), float("-inf"), device=device),
                             ranks=torch.zeros(num_rows, dtype=torch.int64, device=device))
    for index, lp in with_logprobs:
        k = lp.token_ids.shape[1]
        merged.token_ids[index, :k] = lp.token_ids
        merged.logprobs[index, :k] = lp.logprobs
        merged.ranks[index] = lp.ranks
    return SamplerOutput(sampled_token_ids=sampled, logprobs=merged)
