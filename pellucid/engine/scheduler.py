"""Continuous batching: which requests run each step, how many tokens each, with which KV blocks.

Policy (FCFS):
- Running requests go first, in arrival order (decodes and continuing chunked prefills), then waiting
  ones, within a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`).
- With chunked prefill a prompt takes what is left of the budget and continues next step. Without it
  a prompt waits until it fits whole; a request whose recompute after preemption is longer than the
  whole budget is still chunked, since it could never run otherwise.
- When the pool runs out of blocks the latest-arrived running request is preempted by recompute: its
  blocks are freed, its progress reset, and it returns to the front of the waiting queue. Its prompt
  and generated tokens are kept, so the recompute continues the same sequence.
- A request that cannot fit in the pool even alone ends with an error instead of waiting forever.

The scheduler advances request.num_computed_tokens when it schedules a chunk; the runner reads the
snapshot in SchedulerOutput.num_computed_tokens. A step that samples for a request also counts one
pending token for it (request.num_pending_tokens) until update_from_output appends the token.

Scheduling ahead (async scheduling, `schedule(ahead=True)`): the next step is scheduled while the
previous one still runs, so its sampled tokens are pending. A request with a pending token is decoded
again at once (the runner reads that token's id on the device), unless the pending token is its last
one (max_tokens / max_model_len). The engine schedules ahead only while every request can step ahead
(`Request.can_step_ahead`: no host-side token history needed). A step scheduled ahead never preempts,
since a victim's tokens and KV are still being computed: when the pool runs dry it schedules what fit
and sets `ahead_blocked`, and the engine runs the next step serially.

Streaming inputs (a pipeline stage's request, pellucid/pipeline): positions at or past
`request.input_limit` have no inputs yet. Such a request computes up to there (no sampling before its
inputs reach its sequence's end), then is passed over without losing its blocks or its place, while the
others run; a waiting one is passed over too, not in the way of those behind it. When nothing else can
run, `waiting_for_inputs` tells the engine to sleep until the stage's input feature calls
`inputs_changed()`.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Iterable

from pellucid.config import CacheConfig, SchedulerConfig
from pellucid.engine.kv_cache_manager import KVCacheManager
from pellucid.engine.request import Request, RequestStatus
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.logger import get_logger
from pellucid.runner.output import ModelRunnerOutput

logger = get_logger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        if kv_cache_manager.block_size != cache_config.block_size:
            raise ValueError(f"KV cache manager block size {kv_cache_manager.block_size} != "
                             f"cache_config.block_size {cache_config.block_size}")
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        budget = scheduler_config.max_num_batched_tokens
        if budget is None:
            # Same default as the engine: without chunking a whole max-length prompt must fit one step.
            budget = min(max(2048, max_model_len), 8192) if self.chunked_prefill else max_model_len
        if budget < 1 or scheduler_config.max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({budget}) and max_num_seqs "
                             f"({scheduler_config.max_num_seqs}) must be >= 1")
        self.max_num_batched_tokens = budget
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.block_size = cache_config.block_size

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # sorted by arrival priority (see _priority)
        self.requests: dict[str, Request] = {}    # unfinished requests by id
        self._order: dict[str, tuple[float, int]] = {}
        self._arrivals = itertools.count()
        self._finished_ids: set[str] = set()        # freed since the last schedule(), for the runner
        self._finished_unreported: list[Request] = []   # ended by the scheduler itself, for the engine
        self.ahead_blocked = False    # the last step scheduled ahead ran out of KV blocks (see module doc)
        # The last schedule() found every unfinished request waiting for inputs (see module doc).
        self.waiting_for_inputs = False

        # Counters for tests and metrics.
        self.num_steps = 0
        self.total_scheduled_tokens = 0
        self.total_prompt_tokens = 0     # scheduled tokens of chunks that start inside the prompt
        self.prefix_cache_hit_tokens = 0
        self.num_preemptions = 0
        # Tokens appended to requests (a dropped in-flight token is not, nor an embedding request's token).
        self.total_generated_tokens = 0

    # ---- queues ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def has_runnable_requests(self) -> bool:
        """Unfinished requests that a step could advance (not all of them waiting for stage inputs)."""
        return bool(self.running or self.waiting) and not self.waiting_for_inputs

    def inputs_changed(self) -> None:
        """A request's input_limit rose: schedule again."""
        self.waiting_for_inputs = False

    def _priority(self, request: Request) -> tuple[float, int]:
        return self._order[request.request_id]

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (request not queued) when its prompt breaks the model or budget
        limits. A prompt too large for the KV pool is queued and ends with an error at its first
        scheduling attempt, reported through drain_finished_unreported()."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already scheduled")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if n >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt has {n} tokens, which leaves no room for output "
                             f"within max_model_len={self.max_model_len}")
        if not self.chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(f"request {rid!r}: prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} with chunked prefill disabled")
        self._order[rid] = (request.arrival_time, next(self._arrivals))
        self.requests[rid] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.waiting_for_inputs = False

    # ---- scheduling -----------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """The next step. With ahead=True a step is still in flight (see the module doc)."""
        out = SchedulerOutput()
        self.ahead_blocked = False
        budget = self.max_num_batched_tokens
        # Bound methods as locals: this runs once per request per step, for hundreds of requests.
        append_request = out.requests.append
        append_scheduled = out.num_scheduled_tokens.append
        append_computed = out.num_computed_tokens.append
        append_samples = out.samples.append
        prompt_tokens = 0

        def add(request: Request, num_computed: int, num_tokens: int) -> None:
            nonlocal budget, prompt_tokens
            append_request(request)
            append_scheduled(num_tokens)
            append_computed(num_computed)
            samples = num_computed + num_tokens == len(request.all_token_ids) + request.num_pending_tokens
            append_samples(samples)
            if samples:
                request.num_pending_tokens += 1
            if num_computed < len(request.prompt_token_ids):
                prompt_tokens += num_tokens
            request.num_computed_tokens = num_computed + num_tokens
            budget -= num_tokens

        # Running requests, highest priority first. Victims of preemption come off the tail, which
        # is never scheduled yet in this step because the list is in priority order.
        running = self.running
        kv = self.kv
        no_work_limit = kv.no_work_limits.get
        num_input_blocked = 0
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            pending = request.num_pending_tokens
            # Tokens known or pending: the sequence as far as any launched step takes it.
            num_known = len(request.all_token_ids) + pending
            # Pending tokens exist only while a step is in flight, i.e. when scheduling ahead, and the engine
            # schedules ahead only when every request can_step_ahead.
            if pending and num_known >= request.max_total_tokens:
                index += 1      # its pending token is its last
                continue
            if request.input_limit < num_known:
                # A pipeline stage's request: compute what has inputs, then wait for the next chunk.
                if request.input_limit <= num_computed:
                    num_input_blocked += 1
                    index += 1
                    continue
                num_new = self._num_tokens_to_schedule(request, num_computed, budget)
                if num_new and kv.allocate_slots(request, num_new):    # (a full pool: it retries next step)
                    add(request, num_computed, num_new)
                index += 1
                continue
            num_new = num_known - num_computed
            if 0 < num_new <= budget and num_known <= no_work_limit(request.request_id, 0):
                # A decode (or a chunk) with room in its held blocks and no block to publish: allocate_slots
                # would do nothing. This is add() inlined, for a chunk reaching num_known, so it samples;
                # it runs for every request of a decode batch every step.
                append_request(request)
                append_scheduled(num_new)
                append_computed(num_computed)
                append_samples(True)
                request.num_pending_tokens = pending + 1
                if num_computed < len(request.prompt_token_ids):
                    prompt_tokens += num_new
                request.num_computed_tokens = num_known
                budget -= num_new
                index += 1
                continue
            if num_new > budget or num_new == 0:
                num_new = self._num_tokens_to_schedule(request, num_computed, budget)
                if num_new == 0:
                    index += 1
                    continue
            # Decodes almost always fit in the blocks they hold: allocate_slots answers that quickly.
            if kv.allocate_slots(request, num_new):
                add(request, num_computed, num_new)
                index += 1
                continue
            if not kv.can_ever_fit(num_computed + num_new):
                self._finish_unscheduled(request, self._too_big_message(request))
                continue   # the list shrank at `index`
            if ahead:
                self.ahead_blocked = True   # no preemption while a step is in flight
                break
            while not kv.allocate_slots(request, num_new):
                victim = running[-1]
                self._preempt(victim)
                out.preempted_request_ids.add(victim.request_id)
                if victim is request:
                    break
            else:
                add(request, num_computed, num_new)
                index += 1

        # Waiting requests, FCFS; none after a preemption, which would re-admit what was just evicted.
        passed_over: list[Request] = []     # waiting for their first inputs: they keep their place
        while self.waiting and budget > 0 and not out.preempted_request_ids and not self.ahead_blocked \
                and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.input_limit == 0:
                passed_over.append(self.waiting.popleft())
                continue
            if not self.kv.can_ever_fit(request.num_tokens):
                self.waiting.popleft()
                self._finish_unscheduled(request, self._too_big_message(request))
                continue
            cached_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = self._num_tokens_to_schedule(request, num_cached, budget)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, cached_blocks):
                break   # FCFS: later requests wait behind it
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.prefix_cache_hit_tokens += num_cached
            bisect.insort(self.running, request, key=self._priority)
            add(request, num_cached, num_new)
        if passed_over:
            self.waiting.extendleft(reversed(passed_over))
        self.waiting_for_inputs = out.is_empty and num_input_blocked == len(self.running) and \
            self._nothing_but_inputs_can_help(num_input_blocked)

        out.finished_request_ids = self._finished_ids
        self._finished_ids = set()
        self.num_steps += 1
        self.total_scheduled_tokens += out.total_num_scheduled_tokens
        self.total_prompt_tokens += prompt_tokens
        return out

    def _nothing_but_inputs_can_help(self, num_running_blocked: int) -> bool:
        """After a step that scheduled nothing while every running request waits for inputs: whether the
        waiting queue is stuck too (empty, all waiting for their first inputs, or behind max_num_seqs), and
        something waits for inputs at all."""
        waiting_blocked = all(r.input_limit == 0 for r in self.waiting)
        stuck = waiting_blocked or len(self.running) >= self.max_num_seqs
        return stuck and (num_running_blocked > 0 or (bool(self.waiting) and waiting_blocked))

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens of `request` to compute this step given `budget`; 0 when it must wait."""
        remaining = min(request.num_tokens, request.input_limit) - num_computed
        if remaining <= budget:
            return remaining
        chunkable = self.chunked_prefill or remaining > self.max_num_batched_tokens
        return budget if chunkable else 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        log = logger.warning if self.num_preemptions == 1 else logger.debug
        log("KV cache full: preempted request %s (recomputed later; %d preemptions so far). "
            "More KV blocks or a lower max_num_seqs avoid this.", request.request_id, self.num_preemptions)

    def _too_big_message(self, request: Request) -> str:
        needed = self.kv.blocks_needed(request.num_tokens)
        return (f"request needs {needed} KV blocks for {request.num_tokens} tokens but the KV cache has only "
                f"{self.kv.block_pool.num_usable_blocks}; give the KV cache more memory or lower max_tokens")

    # ---- results --------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results: append sampled tokens, run token-level stop checks, end failed
        requests. Returns the requests that got a token or finished. Stop strings are the frontend's job
        (it ends such requests through the engine's finish_requests)."""
        changed: list[Request] = []
        append_changed = changed.append
        errors = runner_output.errors
        sampled = runner_output.sampled_token_ids
        running = RequestStatus.RUNNING
        num_generated = 0
        # This loop runs for every request of the batch every step: the token append and the stop checks
        # are inlined (Request.append_output_token, _check_stop) to spare two calls per request.
        for request, samples in zip(scheduler_output.requests, scheduler_output.samples):
            if samples:
                request.num_pending_tokens -= 1
            if request.status is not running:
                continue   # ended (abort, stop) while the step ran: its token is dropped
            if errors and request.request_id in errors:
                self._finish(request, RequestStatus.FINISHED_ERROR, error=errors[request.request_id])
                append_changed(request)
                continue
            if not samples:
                continue
            token = sampled.get(request.request_id)
            if token is None or token < 0:
                request.bad_request = token is not None     # NO_TOKEN: its constraints contradict each other
                self._finish(request, RequestStatus.FINISHED_ERROR, error=(
                    "the model runner returned no token for a request that was due to sample" if token is None else
                    "no token satisfies the request's constraints: its allowed_token_ids, structured-output grammar "
                    "and min_tokens bans of EOS and stop ids exclude every token"))
                append_changed(request)
                continue
            output_token_ids = request.output_token_ids
            output_token_ids.append(token)
            all_token_ids = request.all_token_ids
            all_token_ids.append(token)
            num_generated += request.counts_as_generation
            grammar = request.grammar
            if grammar is not None and (error := grammar.accept(token)) is not None:
                self._finish(request, RequestStatus.FINISHED_ERROR, error=error)
                append_changed(request)
                continue
            # Token-level stop conditions, in vLLM's order: length, then (past min_tokens) EOS / stop ids; a
            # structured output also ends where its grammar is complete and takes nothing more.
            params = request.sampling_params
            if len(all_token_ids) >= request.max_total_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
            elif grammar is not None and grammar.done:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
            elif not params.min_tokens or len(output_token_ids) >= params.min_tokens:
                if token in request.eos_token_ids:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                elif params.stop_token_ids and token in params.stop_token_ids:
                    request.stop_reason = token
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
            append_changed(request)
        self.total_generated_tokens += num_generated
        return changed

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string, error); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, status)

    def drain_finished_unreported(self) -> list[Request]:
        """Requests the scheduler ended by itself (they never fit the KV cache) since the last call; the
        engine reports them, since no runner output mentions them."""
        requests, self._finished_unreported = self._finished_unreported, []
        return requests

    def _finish_unscheduled(self, request: Request, error: str) -> None:
        logger.error("request %s cannot run: %s", request.request_id, error)
        self._finish(request, RequestStatus.FINISHED_ERROR, error=error)
        self._finished_unreported.append(request)

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        rid = request.request_id
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if error is not None:
            request.error = error
        # A failed request's KV may be wrong: do not leave it in the prefix cache.
        self.kv.free(request, keep_cached=status != RequestStatus.FINISHED_ERROR)
        self.requests.pop(rid, None)
        self._order.pop(rid, None)
        self._finished_ids.add(rid)
        self.waiting_for_inputs = False
