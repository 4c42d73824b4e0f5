"""What the harness measures of an LM head, per row of final hidden states: the token its greedy path
returns and the log-probability its logits give the actual next token.

The engine never returns an approximate head's logits (docs/flashhead.md: prompt logprobs and traced
logits are always exact), so the harness applies the head itself to the engine's hidden states. Each
head name needs an adapter here that says what its logits are; a head without one is an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pellucid.heads.base import LMHead

CHUNK_ELEMENTS = 1 << 24     # bounds the temporaries of one chunk of rows (64 MB of float32)


@dataclass
class HeadScores:
    greedy: torch.Tensor            # [R] int64: the token the head's greedy path returns
    target_logprob: torch.Tensor    # [R] float64: log-probability of the actual next token
    target_exact: torch.Tensor      # [R] bool: the target's logit was computed exactly (not estimated)


@dataclass(frozen=True)
class HeadAdapter:
    build_options: Callable[[dict[str, Any]], dict[str, Any]]
    score: Callable[[LMHead, torch.Tensor, torch.Tensor], HeadScores]
    elements_per_row: Callable[[LMHead], int]     # size of the largest per-row temporary


def _score_dense(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor) -> HeadScores:
    logits = head.compute_logits(hidden)
    logprobs = torch.log_softmax(logits.double(), dim=1).gather(1, targets[:, None]).squeeze(1)
    return HeadScores(logits.argmax(dim=1), logprobs, torch.ones_like(targets, dtype=torch.bool))


def flashhead_logits(head: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashHead's own estimate of the full logits, from what its two stages compute: the exact logit for
    every token of the probed clusters (stage 2), and for every other token its cluster's centroid score
    (stage 1; the centroid is the mean of the cluster's rows, so the score is the cluster's mean logit).
    With probes = clusters it is the dense logits. Returns (logits [R, V] float32, exact mask [R, V])."""
    token_ids, exact_logits = head.candidates(hidden)
    scores = hidden.float() @ head.centroids.float().t()                       # [R, C]
    members = head.cluster_token_ids
    cluster_of = torch.empty(head.vocab_size, dtype=torch.long, device=hidden.device)
    valid = members >= 0
    cluster_of[members[valid]] = torch.arange(members.shape[0], device=hidden.device)[:, None].expand_as(members)[valid]
    logits = scores[:, cluster_of]
    exact = torch.zeros_like(logits, dtype=torch.bool)
    rows, slots = (token_ids >= 0).nonzero(as_tuple=True)
    logits[rows, token_ids[rows, slots]] = exact_logits[rows, slots].float()
    exact[rows, token_ids[rows, slots]] = True
    return logits, exact


def _score_flashhead(head: Any, hidden: torch.Tensor, targets: torch.Tensor) -> HeadScores:
    logits, exact = flashhead_logits(head, hidden)
    logprobs = torch.log_softmax(logits.double(), dim=1).gather(1, targets[:, None]).squeeze(1)
    return HeadScores(head.greedy(hidden), logprobs, exact.gather(1, targets[:, None]).squeeze(1))


def _flashhead_options(options: dict[str, Any]) -> dict[str, Any]:
    # The harness calls the fast path directly, so the batch-size crossover (measured at startup on
    # CUDA) would only cost time.
    return {"max_fast_batch": None, **options}


ADAPTERS: dict[str, HeadAdapter] = {
    "dense": HeadAdapter(lambda options: dict(options), _score_dense, lambda head: head.vocab_size),
    # Off CUDA, stage 2 gathers probes x cluster_size head rows per hidden row (the Triton kernel does not).
    "flashhead": HeadAdapter(_flashhead_options, _score_flashhead, lambda head: max(
        head.vocab_size, head.probes * head.cluster_size * (1 if head.weight.is_cuda else head.weight.shape[1]))),
}


def adapter_for(name: str) -> HeadAdapter:
    if name not in ADAPTERS:
        raise ValueError(f"pellucid eval has no adapter for LM head {name!r} (known: {', '.join(sorted(ADAPTERS))}); "
                         "add one to pellucid/eval/heads.py saying what its logits are")
    return ADAPTERS[name]


def score_rows(head: LMHead, adapter: HeadAdapter, hidden: torch.Tensor, targets: torch.Tensor) -> HeadScores:
    rows = max(1, CHUNK_ELEMENTS // adapter.elements_per_row(head))
    parts = [adapter.score(head, hidden[start:start + rows], targets[start:start + rows])
             for start in range(0, hidden.shape[0], rows)]
    return HeadScores(*(torch.cat([getattr(p, field) for p in parts]).cpu()
                        for field in ("greedy", "target_logprob", "target_exact")))
