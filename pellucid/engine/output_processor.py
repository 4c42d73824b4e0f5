"""Turns engine progress into RequestOutputs: detokenization, stop strings, logprobs, n > 1 fan-in."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pellucid.engine.request import Request
from pellucid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pellucid.runner.output import ModelRunnerOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import IncrementalDetokenizer


@dataclass
class SequenceState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
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


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            children: list[Request]) -> None:
        seqs = [SequenceState(req, i, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                              if params.detokenize else None,
                              logprobs=[] if params.logprobs is not None else None)
                for i, req in enumerate(children)]
        parent = ParentState(request_id, prompt, prompt_token_ids, params, seqs)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = parent
        for seq in seqs:
            self.child_to_parent[seq.request.request_id] = (parent, seq)

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
        for req in changed:
            entry = self.child_to_parent.get(req.request_id)
            if entry is None:
                continue
            parent, seq = entry
            new_token = req.request_id in ro.sampled_token_ids
            if new_token and seq.logprobs is not None and req.request_id in ro.logprobs:
                seq.logprobs.append(self._position_logprobs(ro.logprobs[req.request_id]))
            if new_token and seq.detok is not None:
                token = req.output_token_ids[-1]
                is_stop_token = req.status.finished and req.stop_reason == token
                text_before = len(seq.detok.text)
                if not is_stop_token or parent.params.include_stop_str_in_output:
                    seq.detok.add(token)
                if not req.is_finished and self._find_stop_string(parent.params, seq, text_before):
                    stopped.append(req.request_id)
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
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            outputs.append(self._output(parent))
            if all(s.request.is_finished for s in parent.seqs):
                self._forget(parent)
        return outputs

    def parents_of(self, child_ids: list[str]) -> set[str]:
        return {self.child_to_parent[c][0].request_id for c in child_ids if c in self.child_to_parent}

    def _output(self, parent: ParentState) -> RequestOutput:
        completions = [self._completion(parent, seq) for seq in parent.seqs]
        finished = all(s.request.is_finished for s in parent.seqs)
        errors = [s.request.error for s in parent.seqs if s.request.error]
        first = parent.seqs[0].request
        metrics = {"arrival_time": first.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0), error=errors[0] if errors else None,
            metrics=metrics, extras=dict(first.extras.get("outputs", {})))

    def _completion(self, parent: ParentState, seq: SequenceState) -> CompletionOutput:
        req = seq.request
        params = parent.params
        if seq.detok is None:
            text = ""
        elif seq.stop_string is not None:
            text = seq.text
        elif not req.is_finished and params.stop_strings and not params.include_stop_str_in_output:
            # Hold back a possible partial stop string so streamed text never has to be retracted.
            hold = max(len(s) for s in params.stop_strings) - 1
            text = seq.detok.text[:len(seq.detok.text) - hold] if hold else seq.detok.text
        elif req.is_finished:
            text = self._final_text(params, req)
        else:
            text = seq.detok.text
        stop_reason = seq.stop_string if seq.stop_string is not None else req.stop_reason
        return CompletionOutput(index=seq.index, text=text, token_ids=list(req.output_token_ids),
                                logprobs=seq.logprobs, finish_reason=req.finish_reason, stop_reason=stop_reason)

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
            self.child_to_parent.pop(seq.request.request_id, None)
