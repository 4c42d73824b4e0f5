"""The frontend's side of adding a request: text to token ids, every check the engine would make, and
n > 1 fanned out into n engine requests. A bad request is refused here (ValueError, HTTP 400) before
anything reaches the engine."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from pellucid.engine.engine_core import EngineInfo, check_prompt_ids, check_sampling_token_ids
from pellucid.engine.features import check_served_without_logits, get_feature
from pellucid.engine.messages import EngineCoreRequest
from pellucid.sampling_params import SamplingParams


class ExtrasError(ValueError):
    """A request feature refused its value in the request's extras (`key`: which feature)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class ProcessedRequest:
    """A validated request: what the output processor tracks and the engine requests to send."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]
    feature_keys: tuple[str, ...]        # its features that publish outputs (see OutputProcessor)

    @property
    def child_ids(self) -> list[str]:
        return [r.request_id for r in self.engine_requests]


class InputProcessor:
    def __init__(self, tokenizer: Any, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the engine's limits; ValueError otherwise."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        info = self.info
        check_prompt_ids(ids, info.vocab_size, info.max_model_len, info.enable_chunked_prefill,
                         info.max_num_batched_tokens)
        return ids

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                extras: dict[str, Any] | None = None, stream: bool = True) -> ProcessedRequest:
        """Everything checked; ValueError naming the problem otherwise."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n > self.info.max_num_seqs:
            # Each of the n sequences is a request of its own: without a bound, one request could queue any number.
            raise ValueError(f"n must be at most the engine's max_num_seqs ({self.info.max_num_seqs}), got {params.n}; "
                             f"send several requests for more sequences")
        limit = self.info.max_logprobs if self.info.max_logprobs >= 0 else self.info.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be at most the engine's max_logprobs ({limit}), got {value}; start "
                                 f"the engine with a larger max_logprobs (-1: the whole vocabulary)")
        check_sampling_token_ids(params, self.info.vocab_size)
        if params.structured_outputs is not None:
            params.structured_outputs.check()
        ids = self.prompt_ids(prompt)
        max_total = _max_total_tokens(len(ids), params.max_tokens, self.info.max_model_len)
        check_served_without_logits(extras, self.info.computes_logits)
        checked: dict[str, Any] = {}
        for key, value in (extras or {}).items():
            try:
                checked[key] = get_feature(key).check(value, ids, params, max_total, self.info)
            except ValueError as exc:
                raise ExtrasError(key, str(exc)) from exc
        # The engine reports a request every step only when something here needs its tokens as they come.
        engine_stream = (stream or (params.detokenize and bool(params.stop_strings)) or params.logprobs is not None
                         or params.prompt_logprobs is not None)
        arrival = time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(EngineCoreRequest(child_id, ids, child_params, arrival, engine_stream,
                                              dict(checked) if checked else None))
        publishing = tuple(key for key in checked if get_feature(key).publishes_outputs)
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else None, ids, params, children,
                                publishing)


def send(client: Any, request: ProcessedRequest) -> None:
    """Send a request's engine requests; if one cannot be sent, end the ones already sent and re-raise."""
    sent = []
    try:
        for engine_request in request.engine_requests:
            client.add_request(engine_request)
            sent.append(engine_request.request_id)
    except BaseException:
        client.finish_requests(sent)
        raise


def _max_total_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The longest sequence (prompt + output) a request may reach, as the engine's Request computes it."""
    return min(max_model_len, num_prompt_tokens + max_tokens) if max_tokens else max_model_len
