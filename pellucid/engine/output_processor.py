"""Turns engine progress into RequestOutputs: detokenization, stop strings, logprobs, n > 1 fan-in.

Two output modes per request, as in vLLM: a streaming request gets a cumulative RequestOutput every step
it progresses (AsyncLLM, the server); a final-only request (LLM.generate) gets one when it finishes.
A final-only request without stop strings is not detokenized incrementally at all: its text is decoded
once when it finishes (`_final_text`). So the per-step host work of a large offline batch is only the
token bookkeeping, not O(batch) Python objects and tokenizer calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from pellucid.engine.request import Request, RequestStatus
from pellucid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pellucid.runner.output import ModelRunnerOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import IncrementalDetokenizer

# request.extras key whose dict (saves, save_positions, trace_error, ...) becomes RequestOutput.extras.
FEATURE_OUTPUTS_KEY = "outputs"

# `status not in _UNFINISHED` instead of `request.is_finished`: the enum property (and an enum's Python-level
# __hash__ in a set) costs several times more than identity tests, and this runs for every request every step.
_UNFINISHED = tuple(s for s in RequestStatus if not s.finished)


@dataclass
class SequenceState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None   # None when no text is needed before the request finishes
    text: str = ""                      # final text (stop strings trimmed) once finished
    logprobs: list[PositionLogprobs] | None = None
    stop_string: str | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    stream: bool = True                 # False: report only when every sequence finished


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}
        # Children that need work on every new token (incremental text, logprobs); the rest need none.
        self._per_token: dict[str, tuple[ParentState, SequenceState]] = {}
        self._streaming_children: set[str] = set()

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            children: list[Request], stream: bool = True) -> None:
        # Stop strings are searched in the decoded text, so they need it incrementally in either mode.
        incremental = params.detokenize and (stream or bool(params.stop_strings))
        seqs = [SequenceState(req, i, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                              if incremental else None,
                              logprobs=[] if params.logprobs is not None else None)
                for i, req in enumerate(children)]
        parent = ParentState(request_id, prompt, prompt_token_ids, params, seqs, stream=stream)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = parent
        for seq in seqs:
            child_id = seq.request.request_id
            self.child_to_parent[child_id] = (parent, seq)
            if seq.detok is not None or seq.logprobs is not None:
                self._per_token[child_id] = (parent, seq)
            if stream:
                self._streaming_children.add(child_id)

    def children_of(self, request_id: str) -> list[Request]:
        parent = self.parents.get(request_id)
        return [s.request for s in parent.seqs] if parent else []

    # ---- per step -------------------------------------------------------------------------------
    def process_tokens(self, changed: list[Request], ro: ModelRunnerOutput) -> list[str]:
        """Detokenize new tokens and record logprobs; return child ids that completed a stop string."""
        stopped = []
        for rid, (first_pos, entries) in ro.prompt_logprobs.items():
            if rid in self.child_to_parent:
                parent, _ = self.child_to_parent[rid]
                if parent.prompt_logprobs is not None:
                    for j, entry in enumerate(entries):
                        parent.prompt_logprobs[first_pos + j] = self._position_logprobs(entry)
        per_token = self._per_token
        if not per_token:
            return stopped
        sampled = ro.sampled_token_ids
        logprobs = ro.logprobs
        for req in changed:
            rid = req.request_id
            entry = per_token.get(rid)
            if entry is None or rid not in sampled:
                continue
            parent, seq = entry
            if seq.logprobs is not None and rid in logprobs:
                seq.logprobs.append(self._position_logprobs(logprobs[rid]))
            detok = seq.detok
            if detok is None:
                continue
            token = req.output_token_ids[-1]
            params = parent.params
            finished = req.status not in _UNFINISHED
            if finished and req.stop_reason == token and not params.include_stop_str_in_output:
                continue   # a stop token id ends the text without showing
            if params.stop_strings and not finished:
                text_before = len(detok.text)
                detok.add(token)
                if self._find_stop_string(params, seq, text_before):
                    stopped.append(rid)
            else:
                detok.add(token)
        return stopped

    def _find_stop_string(self, params: SamplingParams, seq: SequenceState, text_before: int) -> bool:
        assert seq.detok is not None
        text = seq.detok.text
        if not params.stop_strings or len(seq.request.output_token_ids) < params.min_tokens:
            return False
        longest = max(len(s) for s in params.stop_strings)
        # Only a stop string ending in the newly decoded text can be new.
        window_start = max(0, text_before - longest + 1)
        best: tuple[int, str] | None = None
        for s in params.stop_strings:
            idx = text.find(s, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        seq.text = text[:idx + len(s)] if params.include_stop_str_in_output else text[:idx]
        seq.stop_string = s
        return True

    def _position_logprobs(self, entry: tuple[list[int], list[float], int]) -> PositionLogprobs:
        ids, lps, rank = entry
        out: PositionLogprobs = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in out:
                continue
            out[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j,
                               decoded_token=self.tokenizer.decode([tid]))
        return out

    # ---- outputs --------------------------------------------------------------------------------
    def make_outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        """Cumulative outputs for the given parents; finished parents are forgotten afterwards."""
        outputs = []
        parents = self.parents
        for rid in request_ids:
            parent = parents.get(rid)
            if parent is None:
                continue
            seqs = parent.seqs
            finished = seqs[0].request.status not in _UNFINISHED if len(seqs) == 1 \
                else all(s.request.status not in _UNFINISHED for s in seqs)
            if not (finished or parent.stream):
                continue
            outputs.append(self._output(parent, finished))
            if finished:
                self._forget(parent)
        return outputs

    def parents_of(self, child_ids: list[str]) -> set[str]:
        return {self.child_to_parent[c][0].request_id for c in child_ids if c in self.child_to_parent}

    def parents_to_report(self, changed: list[Request]) -> set[str]:
        """Parents with news for the caller this step: streaming ones that progressed, and every one with
        a sequence that finished (make_outputs holds a final-only parent back until all its sequences are)."""
        streaming = self._streaming_children
        child_to_parent = self.child_to_parent
        touched = set()
        running = RequestStatus.RUNNING   # a changed request is running or finished; `is` is cheaper than .finished
        if not streaming:
            changed = [req for req in changed if req.status is not running]   # final-only: just the finished
        for req in changed:
            rid = req.request_id
            if rid in streaming or req.status is not running:
                entry = child_to_parent.get(rid)
                if entry is not None:
                    touched.add(entry[0].request_id)
        return touched

    def _output(self, parent: ParentState, finished: bool) -> RequestOutput:
        seqs = parent.seqs
        first = seqs[0].request
        if len(seqs) == 1:
            completions = [self._completion(parent, seqs[0], finished)]
            error = first.error
        else:
            completions = [self._completion(parent, seq, finished) for seq in seqs]
            error = next((s.request.error for s in seqs if s.request.error), None)
        metrics = {"arrival_time": first.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        if finished:
            extras = _take_feature_outputs(seqs)
        else:
            # A snapshot: the request keeps its feature outputs until its final output takes them.
            feature_outputs = first.extras.get(FEATURE_OUTPUTS_KEY) if first.extras else None
            extras = dict(feature_outputs) if feature_outputs else {}
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0), error=error,
            metrics=metrics, extras=extras)

    def _completion(self, parent: ParentState, seq: SequenceState, all_finished: bool) -> CompletionOutput:
        req = seq.request
        params = parent.params
        finished = all_finished or req.status not in _UNFINISHED
        if not params.detokenize:
            text = ""
        elif seq.stop_string is not None:
            text = seq.text
        elif finished:
            text = self._final_text(params, req)
        elif seq.detok is None:
            raise RuntimeError(f"request {req.request_id!r} has no incremental text: it is final-only and "
                               "unfinished, so it must not be reported yet")
        elif params.stop_strings and not params.include_stop_str_in_output:
            # Hold back a possible partial stop string so streamed text never has to be retracted.
            hold = max(len(s) for s in params.stop_strings) - 1
            text = seq.detok.text[:len(seq.detok.text) - hold] if hold else seq.detok.text
        else:
            text = seq.detok.text
        stop_reason = seq.stop_string if seq.stop_string is not None else req.stop_reason
        # A copy: outputs are cumulative snapshots, and the request keeps appending to its own list.
        return CompletionOutput(index=seq.index, text=text, token_ids=req.output_token_ids.copy(),
                                logprobs=seq.logprobs, finish_reason=req.status.value if finished else None,
                                stop_reason=stop_reason)

    def _final_text(self, params: SamplingParams, req: Request) -> str:
        """Decode the whole output once at the end, so bytes of an unfinished UTF-8 character at the
        very end show as the tokenizer's replacement text instead of being held back forever."""
        ids = req.output_token_ids
        if ids and req.stop_reason == ids[-1] and not params.include_stop_str_in_output:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.seqs:
            child_id = seq.request.request_id
            self.child_to_parent.pop(child_id, None)
            self._per_token.pop(child_id, None)
            self._streaming_children.discard(child_id)


def _take_feature_outputs(seqs: list[SequenceState]) -> dict[str, Any]:
    """The first sequence's feature outputs, taken out of every sequence's request: the final RequestOutput
    becomes their only owner. Finished requests stay referenced by engine internals until later steps
    (persistent batch rows, the last step's trace); saves left in them would outlive the user's outputs."""
    taken = [s.request.extras.pop(FEATURE_OUTPUTS_KEY, None) if s.request.extras else None for s in seqs]
    return taken[0] if taken[0] else {}
