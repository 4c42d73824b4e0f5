"""The frontend's per-token work: engine outputs (token ids, raw logprobs) in, RequestOutputs out.

Detokenization, stop strings, logprob formatting and n > 1 fan-in happen here, in the frontend's
process, so the engine core never spends its time on text. Two output modes per request, as in vLLM:
a streaming request gets a cumulative RequestOutput every time it progresses (AsyncLLM, the server); a
final-only request (LLM.generate) gets one when it finishes. A final-only request without stop strings
or logprobs is reported by the engine only when it ends, and its text is decoded once then, so a large
offline batch costs no per-step work here.

A stop string is found here, after the engine sampled the token that completes it; `process` returns
such sequences so the caller tells the engine to end them (FinishRequests "stop"). An engine in another
process may have sampled a few more tokens meanwhile: they are dropped here, and a request whose
features publish outputs at its end (saves) waits for the engine's final output, cut to where the
stop string ended it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pellucid.engine.features import get_feature
from pellucid.engine.messages import EngineCoreOutput, LogprobEntry
from pellucid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class SequenceState:
    child_id: str
    index: int
    detok: IncrementalDetokenizer | None   # None when no text is needed before the sequence finishes
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    text: str = ""                       # final text (stop strings trimmed) once a stop string ended it
    stop_string: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    bad_request: bool = False            # the error is the request's own
    extras: dict[str, Any] | None = None
    awaiting_engine: bool = False        # ended here by a stop string; its feature outputs are still to come

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and not self.awaiting_engine


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    stream: bool = True                  # False: report only when every sequence finished
    feature_keys: tuple[str, ...] = ()   # request features whose outputs come with the final output
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class StopFound:
    """A sequence a stop string ended after `num_output_tokens` tokens: the engine must end it there."""

    child_id: str
    num_output_tokens: int


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, tuple[ParentState, SequenceState]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            child_ids: list[str], stream: bool, feature_keys: tuple[str, ...] = ()) -> None:
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Stop strings are searched in the decoded text, so they need it incrementally in either mode.
        incremental = params.detokenize and (stream or bool(params.stop_strings))
        seqs = [SequenceState(child_id, i, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                              if incremental else None, logprobs=[] if params.logprobs is not None else None)
                for i, child_id in enumerate(child_ids)]
        parent = ParentState(request_id, prompt, list(prompt_token_ids), params, seqs, stream, feature_keys)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = parent
        for seq in seqs:
            self.children[seq.child_id] = (parent, seq)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.child_id for s in parent.seqs] if parent is not None else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    # ---- per engine step ---------------------------------------------------------------------------
    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[StopFound]]:
        """Apply one engine report; returns the RequestOutputs to deliver (cumulative snapshots for streaming
        requests, final ones for the others) and the sequences stop strings ended."""
        touched: dict[str, ParentState] = {}
        stops: list[StopFound] = []
        children = self.children
        for out in outputs:
            entry = children.get(out.request_id)
            if entry is None:
                continue        # ended and reported already (tokens sampled past a stop string, say)
            parent, seq = entry
            if seq.awaiting_engine:
                if out.finish_reason is not None:
                    self._take_extras(parent, seq, out)
                    seq.awaiting_engine = False
                    touched[parent.request_id] = parent
                continue
            if seq.finish_reason is not None:
                continue
            if out.new_token_ids and parent.first_token_time is None:
                parent.first_token_time = time.monotonic()
            parent.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and parent.prompt_logprobs is not None:
                first, (ids, lps, ranks) = out.prompt_logprobs
                for j, (row_ids, row_lps, rank) in enumerate(zip(ids.tolist(), lps.tolist(), ranks.tolist())):
                    parent.prompt_logprobs[first + j] = self._position_logprobs((row_ids, row_lps, rank))
            stop = self._add_tokens(parent, seq, out)
            if stop is not None:
                stops.append(stop)
            elif out.finish_reason is not None:
                seq.finish_reason = out.finish_reason
                seq.stop_reason = out.stop_reason
                seq.error = out.error
                seq.bad_request = out.bad_request
                self._take_extras(parent, seq, out)
            if parent.stream or seq.finish_reason is not None:
                touched[parent.request_id] = parent
        return self._outputs(touched), stops

    def _add_tokens(self, parent: ParentState, seq: SequenceState, out: EngineCoreOutput) -> StopFound | None:
        """Append the output's tokens; a StopFound if a stop string completed among them (the sequence then
        ends there, and what follows is dropped)."""
        new = out.new_token_ids
        if seq.logprobs is not None and out.new_logprobs:
            seq.logprobs.extend(self._position_logprobs(lp) for lp in out.new_logprobs)
        detok = seq.detok
        params = parent.params
        if detok is None or not new:
            seq.token_ids.extend(new)
            return None
        last = len(new) - 1
        for i, token in enumerate(new):
            seq.token_ids.append(token)
            final_token = out.finish_reason is not None and i == last
            if final_token and self._unshown(params, out.finish_reason, out.stop_reason, token):
                continue
            text_before = len(detok.text)
            detok.add(token)
            if params.stop_strings and not final_token and self._find_stop_string(params, seq, text_before):
                # The tokens after this one are dropped: they were never appended.
                if seq.logprobs is not None:
                    del seq.logprobs[len(seq.token_ids):]
                seq.finish_reason = "stop"
                seq.stop_reason = seq.stop_string
                seq.awaiting_engine = bool(parent.feature_keys)
                return StopFound(seq.child_id, len(seq.token_ids))
        return None

    def _unshown(self, params: SamplingParams, finish_reason: str | None, stop_reason: Any, token: int) -> bool:
        """The token that stopped a sequence, a stop token id or EOS, ends its text without showing (even
        where special tokens are shown), unless include_stop_str_in_output asks for it (vLLM's rule)."""
        if finish_reason != "stop" or params.include_stop_str_in_output:
            return False
        return stop_reason == token or (stop_reason is None and token in self.eos_token_ids)

    def _find_stop_string(self, params: SamplingParams, seq: SequenceState, text_before: int) -> bool:
        assert seq.detok is not None
        text = seq.detok.text
        if len(seq.token_ids) < params.min_tokens:
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

    def _take_extras(self, parent: ParentState, seq: SequenceState, out: EngineCoreOutput) -> None:
        extras = out.extras or None
        if extras and seq.stop_string is not None:
            # The engine may have computed past the stop string: cut every feature's outputs there.
            for key in parent.feature_keys:
                get_feature(key).trim_outputs(extras, len(parent.prompt_token_ids) + len(seq.token_ids))
        seq.extras = extras

    def _position_logprobs(self, entry: LogprobEntry) -> PositionLogprobs:
        ids, lps, rank = entry
        if not isinstance(ids, list):       # numpy rows, as the engine sends them
            ids, lps = ids.tolist(), lps.tolist()
        out: PositionLogprobs = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in out:
                continue
            out[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j, decoded_token=self.tokenizer.decode([tid]))
        return out

    # ---- outputs ---------------------------------------------------------------------------------
    def _outputs(self, touched: dict[str, ParentState]) -> list[RequestOutput]:
        """Cumulative outputs of the touched parents; finished parents are forgotten afterwards."""
        outputs = []
        for parent in touched.values():
            seqs = parent.seqs
            finished = seqs[0].finished if len(seqs) == 1 else all(seq.finished for seq in seqs)
            if not (finished or parent.stream):
                continue
            outputs.append(self._output(parent, finished))
            if finished:
                self._forget(parent)
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The engine is gone: every unfinished request ends with `error` (its final output)."""
        outputs = []
        for parent in list(self.parents.values()):
            for seq in parent.seqs:
                if not seq.finished:
                    seq.finish_reason, seq.error, seq.awaiting_engine = "error", error, False
            outputs.append(self._output(parent, True))
            self._forget(parent)
        return outputs

    def forget(self, request_id: str) -> None:
        """Drop a request nobody listens to any more (its reader left); the engine is told separately."""
        parent = self.parents.get(request_id)
        if parent is not None:
            self._forget(parent)

    def _output(self, parent: ParentState, finished: bool) -> RequestOutput:
        seqs = parent.seqs
        if len(seqs) == 1:
            completions = [self._completion(parent, seqs[0])]
            error, bad_request = seqs[0].error, seqs[0].bad_request
        else:
            completions = [self._completion(parent, seq) for seq in seqs]
            failed = next((s for s in seqs if s.error), None)
            error, bad_request = (failed.error, failed.bad_request) if failed is not None else (None, False)
        metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        extras = (seqs[0].extras or {}) if finished else {}
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens, error=error, bad_request=bad_request, metrics=metrics,
            extras=extras)

    def _completion(self, parent: ParentState, seq: SequenceState) -> CompletionOutput:
        params = parent.params
        finished = seq.finish_reason is not None
        if not params.detokenize:
            text = ""
        elif seq.stop_string is not None:
            text = seq.text
        elif finished:
            text = self._final_text(params, seq)
        elif seq.detok is None:
            raise RuntimeError(f"request {seq.child_id!r} has no incremental text: it is final-only and "
                               "unfinished, so it must not be reported yet")
        elif params.stop_strings and not params.include_stop_str_in_output:
            # Hold back a possible partial stop string so streamed text never has to be retracted.
            hold = max(len(s) for s in params.stop_strings) - 1
            text = seq.detok.text[:len(seq.detok.text) - hold] if hold else seq.detok.text
        else:
            text = seq.detok.text
        # A copy: outputs are cumulative snapshots, and the sequence keeps appending to its own lists.
        return CompletionOutput(index=seq.index, text=text, token_ids=seq.token_ids.copy(),
                                logprobs=seq.logprobs.copy() if seq.logprobs is not None else None,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def _final_text(self, params: SamplingParams, seq: SequenceState) -> str:
        """Decode the whole output once at the end, so bytes of an unfinished UTF-8 character at the
        very end show as the tokenizer's replacement text instead of being held back forever."""
        ids = seq.token_ids
        if ids and self._unshown(params, seq.finish_reason, seq.stop_reason, ids[-1]):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.seqs:
            self.children.pop(seq.child_id, None)
