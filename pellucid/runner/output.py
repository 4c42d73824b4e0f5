"""What the model runner hands back to the engine after one step (host values only)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)   # request id -> new token
    # request id -> (token ids [k+1], logprobs [k+1], rank of the chosen token) for the sampled token
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # request id -> (first prompt position scored, entries for consecutive positions from there);
    # the entry at position p scores prompt token p given tokens < p (position 0 has none)
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)              # request id -> error message
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)   # request id -> feature payloads
