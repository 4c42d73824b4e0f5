"""What the model runner hands back to the engine after one step (host values only)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)   # request id -> new token
    # request id -> (token ids [k+1], logprobs [k+1], rank of the chosen token) for the sampled token; the
    # arrays are numpy views of the step's host copies (pellucid.engine.messages.LogprobEntry)
    logprobs: dict[str, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    # request id -> (first prompt position scored, (token ids [P, k+1], logprobs [P, k+1], ranks [P])) for P
    # consecutive positions from there; the row for position p scores prompt token p given tokens < p
    prompt_logprobs: dict[str, tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)              # request id -> error message
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)   # request id -> feature payloads
