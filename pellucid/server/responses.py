"""Engine outputs -> OpenAI response objects: choices, streamed deltas, logprobs, usage.

One `ChoiceTracker` per response remembers how much of each choice was already sent, so the
streamed and the non-streamed paths share the same bookkeeping (and the same numbers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from pellucid.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pellucid.server.protocol import (ChatLogprobToken, ChatLogprobs, CompletionLogprobs, PromptLogprob,
                                      PromptLogprobs, TopLogprob, UsageInfo)


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float, str]]:
    """The k most likely alternatives at a position, best first, as (token id, logprob, text)."""
    ranked = sorted((entry.rank, tid, entry) for tid, entry in position.items() if entry.rank <= k)
    return [(tid, entry.logprob, entry.decoded_token or "") for _, tid, entry in ranked]


def _append_token(result: CompletionLogprobs, tid: int, position: PositionLogprobs | None, k: int, text: str,
                  text_offset: int) -> int:
    """Add one token to legacy completions logprobs: its text, logprob and top k (None without a position, as
    for a prompt's first token); returns the next token's offset."""
    chosen = position[tid] if position is not None else None
    token = (chosen.decoded_token or "") if chosen is not None else text
    result.tokens.append(token)
    result.token_logprobs.append(chosen.logprob if chosen is not None else None)
    top = None
    if chosen is not None:
        # As vLLM does, the token itself is listed with the top alternatives.
        top = {token: chosen.logprob}
        top.update({alt: lp for _, lp, alt in _top(position, k)})
    result.top_logprobs.append(top)
    result.text_offset.append(text_offset)
    return text_offset + len(token)


def completion_logprobs(output: CompletionOutput, start: int, k: int, text_offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs for output positions [start:], offsets counted from text_offset."""
    result = CompletionLogprobs()
    positions = output.logprobs or []
    for tid, position in zip(output.token_ids[start:], positions[start:]):
        text_offset = _append_token(result, tid, position, k, "", text_offset)
    return result


def echo_logprobs(request: RequestOutput, k: int, output_logprobs: CompletionLogprobs,
                  decode: Callable[[list[int]], str]) -> CompletionLogprobs:
    """An echoed prompt's logprobs followed by `output_logprobs` (OpenAI's legacy completions with echo): per
    prompt token its text, logprob and top k (the first token has none), offsets counted from 0."""
    result = CompletionLogprobs()
    positions = request.prompt_logprobs or [None] * len(request.prompt_token_ids)
    offset = 0
    for tid, position in zip(request.prompt_token_ids, positions):
        offset = _append_token(result, tid, position, k, decode([tid]) if position is None else "", offset)
    result.tokens += output_logprobs.tokens
    result.token_logprobs += output_logprobs.token_logprobs
    result.top_logprobs += output_logprobs.top_logprobs
    result.text_offset += output_logprobs.text_offset
    return result


def without_generation(output: RequestOutput) -> RequestOutput:
    """An echo-only request's output (OpenAI's echo with max_tokens 0): the token the engine sampled after the
    prompt is dropped, and a choice that finished by a stop or its length ends for its length of 0 (an abort
    or an error stays one)."""
    def ended(reason: str | None) -> str | None:
        return "length" if reason in ("stop", "length") else reason

    outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                   finish_reason=ended(c.finish_reason), stop_reason=None)
               for c in output.outputs]
    return dataclasses.replace(output, outputs=outputs)


def prompt_logprobs(request: RequestOutput, k: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt position its token's entry and the top k alternatives' (None first)."""
    result: PromptLogprobs = []
    for tid, position in zip(request.prompt_token_ids, request.prompt_logprobs or []):
        if position is None:
            result.append(None)
            continue
        result.append({t: PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token or "")
                       for t, e in position.items() if t == tid or e.rank <= k})
    return result


def chat_logprobs(output: CompletionOutput, start: int, k: int) -> ChatLogprobs:
    """Chat logprobs (`logprobs.content`) for output positions [start:]."""
    result = ChatLogprobs()
    positions = output.logprobs or []
    for tid, position in zip(output.token_ids[start:], positions[start:]):
        chosen = position[tid]
        token = chosen.decoded_token or ""
        result.content.append(ChatLogprobToken(
            token=token, logprob=chosen.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))
                          for _, lp, text in _top(position, k)]))
    return result


@dataclass
class ChoiceProgress:
    text_sent: int = 0          # characters of text already sent
    tokens_sent: int = 0        # output positions already sent (logprobs)
    finished: bool = False


@dataclass
class Delta:
    """What is new in one choice since the last time it was sent."""
    index: int
    output: CompletionOutput
    text: str
    token_start: int                # first output position not sent before
    text_start: int                 # characters of this choice sent before
    finish_reason: str | None
    request: RequestOutput          # the output it came from (its prompt's token ids and logprobs)


@dataclass
class ChoiceTracker:
    """Progress of every choice of one response. Choice index = prompt index * n + sequence index."""

    n: int
    echo_only: bool = False     # OpenAI's echo with max_tokens 0: outputs are seen without their generated token
    progress: dict[int, ChoiceProgress] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finals: dict[int, CompletionOutput] = field(default_factory=dict)

    def view(self, output: RequestOutput) -> RequestOutput:
        """The engine's output as this response reports it."""
        return without_generation(output) if self.echo_only else output

    def update(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        deltas = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            progress = self.progress.setdefault(index, ChoiceProgress())
            self.completion_tokens[index] = len(completion.token_ids)
            self.finals[index] = completion
            if progress.finished:
                continue
            new_text = completion.text[progress.text_sent:]
            finish = completion.finish_reason
            if not new_text and finish is None:
                continue
            deltas.append(Delta(index, completion, new_text, progress.tokens_sent, progress.text_sent, finish, output))
            progress.text_sent = len(completion.text)
            progress.tokens_sent = len(completion.token_ids)
            progress.finished = finish is not None
        return deltas

    @property
    def num_generated(self) -> int:
        return sum(self.completion_tokens.values())

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = self.num_generated
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
