"""Embedding and classification requests as a request feature: `extras["pool"] = "last" | "mean" | "cls"`
(an embedding) or `"classify"` (the class logits of a sequence-classification model).

The feature declares that its requests never read their sampled token (`discards_tokens`), so an engine
without an LM head (heads/none.py) serves them, and it holds a request to what an embedding request is: one
greedy token, no logprobs, no constraints.

While such requests run, a step hook (runner/step_hooks.py) reads the backbone's final-normed output of each
step (the rows the LM head reads from) and copies what each request's pooling needs to the host with the
step's tokens:
- "last": the row of its last prompt position, the one it samples from;
- "cls": the row of position 0;
- "mean": the float32 sum of its rows in this step (its prompt may span several chunks), added up on the host;
- "classify": the model's `score` layer (models/sequence_classification.py) applied on the device to the row
  of its last prompt position, as transformers' sequence classifiers pool.
The request's final output carries the pooled vector as `pooled_hidden` ([hidden]; the mean in float32, a
picked row in the model's dtype), or the class logits as `class_logits` ([num_labels], float32). "last" and
"classify" requests read the prefix cache like any other (the last position is always computed); "mean" and
"cls" requests compute every prompt position themselves.
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
CLASS_LOGITS = "class_logits"
CLASSIFY = "classify"
REQUEST_KINDS = (*POOLING_TYPES, CLASSIFY)


class PoolingMarker(RequestFeature):
    key = POOL_KEY
    step_ahead = True
    publishes_outputs = True
    discards_tokens = True

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        _check_kind(value)
        if (params.n != 1 or params.max_tokens != 1 or params.logprobs is not None or params.prompt_logprobs is not None
                or params.structured_outputs is not None or params.logit_bias or params.allowed_token_ids):
            raise ValueError("an embedding or classification request samples one greedy token that nobody reads: "
                             "n=1, max_tokens=1, no logprobs and no output constraints")
        if value == CLASSIFY and not engine_info.num_labels:
            raise ValueError("this model has no classification head: classify needs a *ForSequenceClassification "
                             "checkpoint")
        return value

    def for_engine(self, engine: Any) -> "EnginePooling":
        return EnginePooling(engine.runner)


def _check_kind(value: Any) -> None:
    if value not in REQUEST_KINDS:
        raise ValueError(f"extras['pool'] must be one of {', '.join(REQUEST_KINDS)}, got {value!r}")


class _Pooled:
    """One request's pooling state: the picked row, or the running sum and count of its rows."""

    __slots__ = ("kind", "row", "total", "count")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.restart()

    def restart(self) -> None:
        """Its prompt is computed from position 0 (again, after a preemption)."""
        self.row: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.count = 0

    def result(self, num_prompt_tokens: int) -> torch.Tensor | None:
        if self.kind != "mean":
            return self.row
        return self.total / self.count if self.count == num_prompt_tokens and self.total is not None else None


class EnginePooling(EngineFeature):
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.hook = _PoolingHook(getattr(runner.model, "score", None))

    def prepare(self, request: Any) -> None:
        kind = request.extras[POOL_KEY]
        _check_kind(kind)
        if kind == CLASSIFY and self.hook.score is None:
            raise ValueError("this model has no classification head (`score`): classify needs a "
                             "*ForSequenceClassification checkpoint")
        request.extras[POOL_KEY] = _Pooled(kind)
        if kind in ("mean", "cls"):
            request.read_prefix_cache = False       # every prompt position is read, so computed here

    def set_active(self, active: bool) -> None:
        if active:
            self.runner.add_step_hook(self.hook)
        else:
            self.runner.remove_step_hook(self.hook)

    def after_step(self, changed: list[Any]) -> None:
        for request in changed:
            state = request.extras.get(POOL_KEY) if request.extras else None
            if not (request.is_finished and isinstance(state, _Pooled)):
                continue
            pooled = state.result(request.num_prompt_tokens)
            if pooled is not None:
                if request.feature_outputs is None:
                    request.feature_outputs = {}
                request.feature_outputs[CLASS_LOGITS if state.kind == CLASSIFY else POOLED_HIDDEN] = pooled


class _PoolingHook(StepHook):
    """Per step: the rows each pooling request needs, gathered on the device and copied to the host."""

    def __init__(self, score: torch.nn.Module | None) -> None:
        self.score = score          # the model's classification head, if it has one

    def after_sampling(self, so: Any, batch: Any, hidden: Any, sampled: Any) -> Any:
        picked: list[tuple[int, _Pooled]] = []           # (row, state): "last" and "cls"
        classified: list[tuple[int, _Pooled]] = []       # (row, state): "classify"
        summed: list[tuple[int, int, _Pooled]] = []      # (first row, rows, state): "mean"
        start = 0
        for request, computed, count in zip(so.requests, so.num_computed_tokens, so.num_scheduled_tokens):
            state = request.extras.get(POOL_KEY) if request.extras else None
            if isinstance(state, _Pooled):
                if computed == 0:
                    state.restart()
                if state.kind == "mean":
                    summed.append((start, count, state))
                elif state.kind == "cls" and computed == 0:
                    picked.append((start, state))
                elif computed + count == request.num_prompt_tokens and state.kind in ("last", CLASSIFY):
                    (picked if state.kind == "last" else classified).append((start + count - 1, state))
            start += count
        if not picked and not summed and not classified:
            return None
        picked_rows = copy_to_host(_rows(hidden, picked)) if picked else None
        logits = copy_to_host(self.score(_rows(hidden, classified)).float()) if classified else None
        sums = None
        if summed:
            flat = [row for first, count, _ in summed for row in range(first, first + count)]
            segment = [k for k, (_, count, _) in enumerate(summed) for _ in range(count)]
            index = host_to_device(flat, torch.int64, hidden.device)
            segments = host_to_device(segment, torch.int64, hidden.device)
            totals = torch.zeros(len(summed), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums = copy_to_host(totals.index_add_(0, segments, hidden.index_select(0, index).float()))
        return picked, picked_rows, classified, logits, summed, sums

    def after_readback(self, handle: Any) -> None:
        if handle is None:
            return
        picked, picked_rows, classified, logits, summed, sums = handle
        for (_, state), row in zip(picked, picked_rows if picked_rows is not None else []):
            state.row = row
        for (_, state), row in zip(classified, logits if logits is not None else []):
            state.row = row
        for (_, count, state), total in zip(summed, sums if sums is not None else []):
            state.total = total if state.total is None else state.total + total
            state.count += count


def finished_output(output: Any, key: str, request_kind: str, what: str) -> torch.Tensor:
    """The float32 host tensor a finished pooling request carries under `key`; RuntimeError naming the request
    (`request_kind`: "embedding", "classification") when it failed or finished without it (`what`)."""
    if output.error:
        raise RuntimeError(f"the {request_kind} request {output.request_id} failed: {output.error}")
    value = output.extras.get(key)
    if value is None:
        raise RuntimeError(f"the {request_kind} request {output.request_id} finished without its {what}")
    return value.to(device="cpu", dtype=torch.float32)


def _rows(hidden: torch.Tensor, picked: list[tuple[int, Any]]) -> torch.Tensor:
    return hidden.index_select(0, host_to_device([row for row, _ in picked], torch.int64, hidden.device))


register_feature(PoolingMarker())
