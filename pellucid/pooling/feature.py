"""Embedding requests as a request feature: `extras["pool"] = "last" | "mean" | "cls"`.

The feature declares that its requests never read their sampled token (`discards_tokens`), so an engine
without an LM head (heads/none.py) serves them, and it holds a request to what an embedding request is: one
greedy token, no logprobs, no constraints.

Last-token pooling needs no trace: the hidden state of the row a request samples from, at its last prompt
position, is the LM head's input, which the runner already has. While such requests run, a step hook
(runner/step_hooks.py) copies those rows to the host with the step's tokens, and the request's final output
carries its row as `pooled_hidden` (model dtype, [hidden]). Mean and first-token pooling read positions the
head never sees: their requests carry a trace beside the marker (pellucid/pooling/embedder.py).
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.engine.features import EngineFeature, RequestFeature, register_feature
from pellucid.pooling.config import POOLING_TYPES
from pellucid.runner.sampler import host_to_device
from pellucid.runner.step_hooks import StepHook, copy_to_host

POOL_KEY = "pool"
POOLED_HIDDEN = "pooled_hidden"


class PoolingMarker(RequestFeature):
    key = POOL_KEY
    step_ahead = True
    publishes_outputs = True
    discards_tokens = True

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        if value not in POOLING_TYPES:
            raise ValueError(f"extras['pool'] must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
        if (params.n != 1 or params.max_tokens != 1 or params.logprobs is not None or params.prompt_logprobs is not None
                or params.structured_outputs is not None or params.logit_bias or params.allowed_token_ids):
            raise ValueError("an embedding request samples one greedy token that nobody reads: n=1, max_tokens=1, "
                             "no logprobs and no output constraints")
        return value

    def for_engine(self, engine: Any) -> "EnginePooling":
        return EnginePooling(engine.runner)


class _LastRow:
    """A last-token request's state: its sampled row's hidden state, once read back."""

    __slots__ = ("hidden",)

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None


class EnginePooling(EngineFeature):
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.hook = _LastRowHook()

    def prepare(self, request: Any) -> None:
        value = request.extras[POOL_KEY]
        if value not in POOLING_TYPES:
            raise ValueError(f"extras['pool'] must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
        if value == "last":
            request.extras[POOL_KEY] = _LastRow()

    def set_active(self, active: bool) -> None:
        if active:
            self.runner.add_step_hook(self.hook)
        else:
            self.runner.remove_step_hook(self.hook)

    def after_step(self, changed: list[Any]) -> None:
        for request in changed:
            state = request.extras.get(POOL_KEY) if request.extras else None
            if request.is_finished and isinstance(state, _LastRow) and state.hidden is not None:
                if request.feature_outputs is None:
                    request.feature_outputs = {}
                request.feature_outputs[POOLED_HIDDEN] = state.hidden


class _LastRowHook(StepHook):
    """Copies the hidden state of each last-token request's row at its last prompt position to the host."""

    def after_sampling(self, so: Any, batch: Any, hidden: Any, sampled: Any) -> Any:
        wanted: list[tuple[int, _LastRow]] = []      # (sampling row, the request's state)
        row = 0
        for request, samples, computed, count in zip(so.requests, so.samples, so.num_computed_tokens,
                                                     so.num_scheduled_tokens):
            if not samples:
                continue
            state = request.extras.get(POOL_KEY) if request.extras else None
            if isinstance(state, _LastRow) and state.hidden is None and computed + count == request.num_prompt_tokens:
                wanted.append((row, state))
            row += 1
        if not wanted:
            return None
        rows = batch.sample_rows
        if len(wanted) != len(batch.sample_requests):
            rows = rows.index_select(0, host_to_device([r for r, _ in wanted], torch.int64, rows.device))
        return [state for _, state in wanted], copy_to_host(hidden.index_select(0, rows))

    def after_readback(self, handle: Any) -> None:
        if handle is None:
            return
        states, host = handle
        for state, values in zip(states, host):
            state.hidden = values


register_feature(PoolingMarker())
