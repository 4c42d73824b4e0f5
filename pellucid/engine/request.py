"""A request's state inside the engine: tokens so far, progress, KV blocks, and how it ended."""
from __future__ import annotations

import enum
import sys
import time
from typing import Any

import torch

from pellucid.sampling_params import SamplingParams

# request.extras key whose value partitions the prefix cache (vLLM's `cache_salt`): requests with
# different salts never share blocks, e.g. to keep tenants' prompts from probing each other's cache.
CACHE_SALT_KEY = "cache_salt"

# request.extras keys whose feature works on steps launched ahead of the previous step's readback
# (Request.can_step_ahead); a feature registers its key when it keeps all per-step state on the device.
_STEP_AHEAD_EXTRAS_KEYS: set[str] = set()


def allow_step_ahead_for_extras_key(key: str) -> None:
    """Requests carrying `key` in extras may still step ahead (see Request.can_step_ahead)."""
    _STEP_AHEAD_EXTRAS_KEYS.add(key)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """One sequence. `all_token_ids` is prompt + generated; the first `num_computed_tokens` have KV in cache.

    The scheduler advances `num_computed_tokens` when it schedules a chunk (the runner reads the value
    snapshotted in SchedulerOutput), and the engine appends sampled tokens after the step.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int] | None = None,
                 arrival_time: float | None = None, max_model_len: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled by a launched step and not read back yet (0 or 1). The scheduler counts them as
        # part of the sequence, so with async scheduling the next step can be launched ahead of the
        # readback: the runner takes such a token's id from the device (see ModelRunner.launch).
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1          # prefix-cache hits at first scheduling; -1 until then
        self.block_ids: list[int] = []
        self.block_hashes: list[Any] = []    # filled and owned by the KV cache manager
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # The request's own parameters made it fail while it ran (a client error, not the engine's).
        self.bad_request = False
        self.num_preemptions = 0
        # Prefix-cache policy. A traced request reads cached KV only below the first position it observes
        # (it must compute every position it observes) and an edited request turns publishing off (its KV
        # is not the model's).
        self.read_prefix_cache = True
        self.prefix_cache_read_limit: int | None = None   # a hit covers at most this many leading tokens
        self.publish_prefix_cache = True
        self.counts_as_generation = True     # its tokens count in the engine's generation-token stats
        # Longest sequence this request may reach (prompt + output), set by the engine from max_model_len.
        max_tokens = sampling_params.max_tokens
        limit = max_model_len if max_model_len is not None else len(prompt_token_ids) + (max_tokens or 0)
        self.max_total_tokens = min(limit, len(prompt_token_ids) + max_tokens) if max_tokens else limit
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)
        # Its place in its structured_outputs grammar (pellucid.structured.matcher.GrammarMatcher), set by the
        # engine that queues it; the scheduler feeds it every sampled token.
        self.grammar: Any = None
        self.extras: dict[str, Any] = {}     # per-feature state (trace plan, extraction spec, ...)
        # What features publish when the request finishes (saves, ...): the final output takes them over.
        self.feature_outputs: dict[str, Any] | None = None
        # Report every step it progresses (True) or only when it finishes (see EngineCoreRequest.stream).
        self.stream_outputs = True
        self.num_reported_tokens = 0         # output tokens already reported to the frontend
        # Positions whose inputs are here: the scheduler computes none at or past it. A pipeline stage's
        # request lowers it while it waits for the previous stage's next chunk (pellucid/pipeline).
        self.input_limit = sys.maxsize
        # What features report while the request runs (a pipeline stage's chunk notices), sent with its next
        # output and cleared (EngineCoreOutput.events).
        self.events: dict[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def can_step_ahead(self) -> bool:
        """Whether a step may be launched for this request before its previous token is read back.

        Penalties, min_tokens bans and structured-output masks are built on the host from the tokens
        generated so far, so those requests need their last token first; so do features in `extras` that
        did not register with allow_step_ahead_for_extras_key.
        """
        params = self.sampling_params
        return (not params.needs_penalties and params.min_tokens == 0 and params.structured_outputs is None
                and all(key in _STEP_AHEAD_EXTRAS_KEYS for key in self.extras))

    def append_output_token(self, token_id: int) -> str | None:
        """Add a sampled token; the structured-output grammar's error when it cannot take it, else None."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        return None if self.grammar is None else self.grammar.accept(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Forget output tokens past the first `num_output_tokens` (the frontend ended the request there,
        while later steps had already sampled more)."""
        extra = len(self.output_token_ids) - num_output_tokens
        if extra > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - extra:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
