"""What the frontend and the engine core say to each other, wherever the core runs.

The frontend (LLM, AsyncLLM, the API server) owns text: tokenization, chat templates, detokenization,
stop strings, n > 1 fan-out and fan-in, output assembly. The engine core sees token ids and sampling
parameters only, and answers with token ids, raw logprobs and feature outputs. These types are
msgspec structs so the same objects cross a process boundary as msgpack (pellucid/engine/serial.py)
or are handed over as they are to an engine in the same process.
"""
from __future__ import annotations

import pickle
from typing import Any, Union

import msgspec

from pellucid.sampling_params import SamplingParams

# One sampled position's logprobs: (token ids [k+1], logprobs [k+1], rank of the first id), the two as
# numpy arrays: they cross a process boundary as raw bytes, with no Python object per value.
LogprobEntry = tuple[Any, Any, int]
# Consecutive prompt positions' logprobs: (token ids [P, k+1], logprobs [P, k+1], ranks [P]), numpy arrays.
PromptLogprobs = tuple[Any, Any, Any]


class EngineCoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """One sequence for the engine (the frontend has already fanned n > 1 out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # True: report every step the request progresses (streaming, stop strings and logprobs need the
    # tokens as they come); False: report once, when it finishes, with all its tokens.
    stream: bool = True
    # Feature state riding on the request (pellucid/engine/features.py), keyed by feature.
    extras: dict[str, Any] | None = None
    # `extras` pickled, as it crosses a process boundary: feature values are arbitrary objects (a trace
    # plan, dataclasses) that msgpack would flatten into dicts (see with_pickled_extras).
    pickled_extras: bytes | None = None

    def with_pickled_extras(self) -> "EngineCoreRequest":
        if self.extras is None:
            return self
        return msgspec.structs.replace(self, extras=None, pickled_extras=pickle.dumps(self.extras))

    def with_unpickled_extras(self) -> "EngineCoreRequest":
        if self.pickled_extras is None:
            return self
        return msgspec.structs.replace(self, extras=pickle.loads(self.pickled_extras), pickled_extras=None)


class FinishRequests(msgspec.Struct, tag=True, omit_defaults=True):
    """End requests from the frontend: `abort` (client gone, shutdown) or `stop` (a stop string
    completed at `num_output_tokens[i]` tokens; the engine drops any tokens it sampled past that)."""

    request_ids: list[str]
    reason: str = "abort"
    num_output_tokens: list[int] | None = None


class UtilityCall(msgspec.Struct, tag=True, omit_defaults=True):
    """Call one of the engine core's declared utility methods (EngineCore.UTILITIES); the result comes
    back as a UtilityResult with the same call id."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True):
    """Abort everything in flight and exit."""


EngineInput = Union[EngineCoreRequest, FinishRequests, UtilityCall, Shutdown]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's progress in one step: its new tokens (all of them in a final-only request's
    single report), their raw logprobs, and how it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry] | None = None
    # (first prompt position scored, the logprobs of consecutive positions from there)
    prompt_logprobs: tuple[int, PromptLogprobs] | None = None
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None      # the stop token id that ended it
    error: str | None = None
    num_cached_tokens: int = 0
    extras: dict[str, Any] | None = None      # feature outputs (saves, ...), in the final output only
    # What features report while the request runs, since its last output (a pipeline stage's chunk notices
    # and audio, pellucid/pipeline); None for most requests.
    events: dict[str, Any] | None = None
    bad_request: bool = False                 # the error is the request's own (Request.bad_request)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0                # wall time spent in steps (the engine's busy time)
    num_steps_ahead: int = 0
    num_graph_steps: int = 0                 # steps that replayed a decode CUDA graph
    num_step_failures: int = 0
    num_aborted: int = 0
    num_requests_added: int = 0              # requests the engine core queued
    num_requests_refused: int = 0            # requests it refused (the frontend checks first)
    lm_head_usage: dict[str, int] = {}       # rows served per head path (LMHead.usage())


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step (or one utility call) reports. `engine_error` set: the engine core
    is going down and says why; every request still in flight has failed."""

    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    utility_results: list[UtilityResult] | None = None
    engine_error: str | None = None
