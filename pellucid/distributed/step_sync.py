"""The steps rank 0 sends to the other tensor-parallel ranks, and the other ranks' copies of the requests.

The scheduler runs once, in the engine core. For each step rank 0 sends a `StepMessage`: the batch as
request ids in order with the scheduler's numbers, plus what each worker's copy of a request lacks: the
whole request the first time it is scheduled, later only the tokens and KV blocks added since it was last
sent. From that a worker rebuilds the step's SchedulerOutput over its own Request objects and runs the
same ModelRunner.launch as rank 0, building the same host metadata into its own buffers (one host-to-device
copy per rank per step). Tokens sampled by a step still in flight are not in any message: every rank takes
them from the device, where rank 0's broadcast put them (ModelRunner._launch_sampling).

A worker's Request lives from its request's first scheduled step until rank 0 reports it finished; it
keeps its seeded generator across preemptions, so every rank draws the same per-step seeds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pellucid.engine.features import get_feature
from pellucid.engine.request import Request
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    # What of the request's extras every rank's runner reads, per feature (RequestFeature.for_ranks).
    rank_extras: dict[str, Any]


@dataclass
class StepMessage:
    new_requests: list[NewRequestData] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)            # the batch, in order
    new_token_ids: list[list[int]] = field(default_factory=list)    # per request: tokens added since last sent
    block_offsets: list[int] = field(default_factory=list)          # per request: blocks kept before new_block_ids
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)   # forget these (before adding new_requests)
    trace_possible: bool = True

    @property
    def is_empty(self) -> bool:
        return not self.request_ids


class StepEncoder:
    """Rank 0's side: what each worker already holds of each request, and the message for the next step."""

    def __init__(self) -> None:
        # request id -> [tokens sent, blocks sent]
        self._sent: dict[str, list[int]] = {}
        self._finished: list[str] = []      # finished outside a step, to forget with the next message

    def forget(self, request_ids: set[str] | list[str]) -> None:
        """Requests that ended while no step ran: the workers drop them with the next message."""
        self._finished.extend(rid for rid in request_ids if rid in self._sent)
        for rid in request_ids:
            self._sent.pop(rid, None)

    def encode(self, so: SchedulerOutput, trace_possible: bool) -> StepMessage:
        msg = StepMessage(num_scheduled_tokens=list(so.num_scheduled_tokens),
                          num_computed_tokens=list(so.num_computed_tokens), samples=list(so.samples),
                          trace_possible=trace_possible)
        sent = self._sent
        self.forget(so.finished_request_ids)
        msg.finished_request_ids, self._finished = self._finished, []
        for rid in so.preempted_request_ids:
            if rid in sent:
                sent[rid][1] = 0          # its blocks were freed: the next schedule sends them all again
        for req in so.requests:
            rid = req.request_id
            state = sent.get(rid)
            tokens = req.all_token_ids
            if state is None:
                state = sent[rid] = [len(tokens), 0]
                msg.new_requests.append(NewRequestData(
                    rid, list(req.prompt_token_ids), list(req.output_token_ids), req.sampling_params,
                    sorted(req.eos_token_ids), _rank_extras(req)))
                msg.new_token_ids.append([])
            else:
                msg.new_token_ids.append(tokens[state[0]:] if len(tokens) > state[0] else [])
                state[0] = len(tokens)
            msg.request_ids.append(rid)
            msg.block_offsets.append(state[1])
            msg.new_block_ids.append(req.block_ids[state[1]:])
            state[1] = len(req.block_ids)
        return msg


def _rank_extras(request: Request) -> dict[str, Any]:
    out = {}
    for key, value in request.extras.items():
        shared = get_feature(key).for_ranks(value)
        if shared is not None:
            out[key] = shared
    return out


class WorkerRequests:
    """A worker's side: its Request objects, kept in step with rank 0's by the messages."""

    def __init__(self, max_model_len: int, bind_extras: Callable[[str, Any, Request], Any],
                 grammar_for: Callable[[Request], Any] | None = None) -> None:
        self.max_model_len = max_model_len
        self._bind_extras = bind_extras      # (key, value from for_ranks, request) -> the request's extras[key]
        # request -> its structured-output matcher, fed the same tokens as rank 0's (this rank builds its masks)
        self._grammar_for = grammar_for
        self.requests: dict[str, Request] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        """The step's SchedulerOutput over this worker's requests (empty when the message only forgets)."""
        requests = self.requests
        for rid in msg.finished_request_ids:
            requests.pop(rid, None)
        for new in msg.new_requests:
            req = Request(new.request_id, new.prompt_token_ids, new.sampling_params, set(new.eos_token_ids),
                          max_model_len=self.max_model_len)
            if new.sampling_params.structured_outputs is not None:
                if self._grammar_for is None:
                    raise ValueError("this rank cannot build structured-output matchers")
                req.grammar = self._grammar_for(req)
            for token in new.output_token_ids:
                req.append_output_token(token)
            for key, value in new.rank_extras.items():
                req.extras[key] = self._bind_extras(key, value, req)
            requests[new.request_id] = req
        batch = []
        for rid, tokens, offset, blocks in zip(msg.request_ids, msg.new_token_ids, msg.block_offsets,
                                               msg.new_block_ids):
            req = requests[rid]
            for token in tokens:
                req.append_output_token(token)
            if offset != len(req.block_ids):
                req.block_ids = req.block_ids[:offset] + blocks     # blocks freed and allocated anew
            elif blocks:
                req.block_ids.extend(blocks)
            batch.append(req)
        return SchedulerOutput(requests=batch, num_scheduled_tokens=msg.num_scheduled_tokens,
                               num_computed_tokens=msg.num_computed_tokens, samples=msg.samples)
