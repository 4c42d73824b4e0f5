"""What the scheduler decided for one step; the runner reads only this (and the Request objects in it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pellucid.engine.request import Request


@dataclass
class SchedulerOutput:
    """Requests in batch order. Request i computes tokens
    `all_token_ids[num_computed_tokens[i] : num_computed_tokens[i] + num_scheduled_tokens[i]]`
    at those positions, writing their KV into `request.block_ids`. It samples a token this step
    iff `samples[i]` (the chunk reaches the end of the known tokens)."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)   # snapshot before this step
    samples: list[bool] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)    # freed since the previous step
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests
