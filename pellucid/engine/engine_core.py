"""The engine core shared by LLM, AsyncLLM and the server: requests in, one step at a time, outputs out."""
from __future__ import annotations

import dataclasses
import operator
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.config import EngineConfig, resolve_device, resolve_dtype
from pellucid.engine.block_pool import BlockPool
from pellucid.engine.kv_cache_manager import KVCacheManager
from pellucid.engine.output_processor import OutputProcessor
from pellucid.engine.request import Request, RequestStatus
from pellucid.engine.scheduler import Scheduler
from pellucid.logger import get_logger
from pellucid.models.loader import load_model
from pellucid.outputs import RequestOutput
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.runner.model_runner import LaunchedStep, ModelRunner
from pellucid.runner.output import ModelRunnerOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import eos_token_ids, load_tokenizer
from pellucid.tracing.plan import TRACE_KEY, finish_traced_requests, prepare_traced_request

logger = get_logger(__name__)


@dataclass
class _InFlight:
    """A scheduled step whose device work was launched and whose results are not collected yet."""

    so: SchedulerOutput
    launched: LaunchedStep | None
    failed: ModelRunnerOutput | None = None   # the errors of a step whose launch raised


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = torch.device(resolve_device(config.runner.device))
        self.tokenizer = load_tokenizer(mc.tokenizer or mc.model)
        torch.manual_seed(mc.seed)
        dtype = resolve_dtype(mc.dtype, str(self.device), _config_dtype(mc.model))
        self.model, self.hf_config = load_model(mc.model, dtype, self.device, mc.max_model_len)
        self.dtype = next(self.model.parameters()).dtype
        self.model_name = mc.served_model_name or mc.model
        self.max_model_len = self._max_model_len()
        sc = config.scheduler
        if sc.max_num_batched_tokens is None:
            sc.max_num_batched_tokens = min(max(2048, self.max_model_len), 8192) if sc.enable_chunked_prefill \
                else self.max_model_len
        self.eos_token_ids = eos_token_ids(mc.model, self.tokenizer, self.hf_config)
        self.runner = ModelRunner(config, self.model, self.hf_config, self.device, self.dtype,
                                  self.max_model_len, sc.max_num_batched_tokens)
        self.num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        self._resolve_prefix_caching()
        self.block_pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sc, config.cache, self.kv_manager, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self._pending_outputs: set[str] = set()   # parents with news not yet reported (aborts, errors)
        if sc.async_scheduling is None:
            sc.async_scheduling = self.device.type == "cuda"
        self.async_scheduling = sc.async_scheduling
        self._in_flight: _InFlight | None = None  # the step launched ahead (async scheduling)
        self._traced: list[Request] = []         # unfinished traced requests (their saves are finished per step)
        self._serial_only: list[Request] = []    # unfinished requests that cannot step ahead (can_step_ahead)
        self.runner.trace_possible = False
        self.num_discarded_tokens = 0            # in-flight tokens of requests that ended before them
        self.num_steps_ahead = 0                 # steps launched before the previous one was read back
        self.prompt_tokens_total = 0
        self.num_steps = 0
        logger.info("engine ready: model=%s dtype=%s device=%s max_model_len=%d KV cache: %d blocks x %d tokens "
                    "= %d tokens; prefix caching %s, chunked prefill %s (budget %d tokens/step)",
                    mc.model, str(self.dtype).removeprefix("torch."), self.device, self.max_model_len,
                    self.num_blocks, config.cache.block_size, self.num_blocks * config.cache.block_size,
                    "on" if config.cache.enable_prefix_caching else "off",
                    "on" if sc.enable_chunked_prefill else "off", sc.max_num_batched_tokens)

    # ---- prefix caching vs hybrid models (begin) -------------------------------------------------
    def _resolve_prefix_caching(self) -> None:
        """Turn `enable_prefix_caching` (None = wherever the model supports it) into a bool.

        A hybrid model's recurrent state summarises the whole prefix and cannot be rebuilt from cached
        attention KV, so such models never read or publish prefix-cache blocks; a user who asked for prefix
        caching explicitly is told why it is off.
        """
        cache = self.config.cache
        asked = cache.enable_prefix_caching
        supported = self.runner.supports_prefix_caching
        if not supported and asked is not False:
            arch = type(self.model).__name__
            reason = (f"{arch} keeps per-request recurrent state that cached attention KV cannot restore, "
                      "so every request computes its prompt from the start")
            if asked:
                logger.warning("enable_prefix_caching=True was asked for, but prefix caching is off: %s", reason)
            else:
                logger.info("prefix caching off: %s", reason)
        cache.enable_prefix_caching = supported and asked is not False
    # ---- prefix caching vs hybrid models (end) ---------------------------------------------------

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        asked = self.config.model.max_model_len
        if asked is None:
            if limit is None:
                raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
            return int(limit)
        if limit is not None and asked > limit:
            raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}")
        return asked

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a prompt, or ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = self.runner.head.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room for output within "
                             f"max_model_len={self.max_model_len}")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and len(ids) > sc.max_num_batched_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                             f"{sc.max_num_batched_tokens} with chunked prefill disabled")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    extras: dict[str, Any] | None = None, stream: bool = True) -> None:
        """Queue a request. With stream=True step() reports it every step it progresses (cumulative
        outputs, for AsyncLLM and the server); with stream=False only once, when it finishes (LLM.generate),
        which spares the per-step output building and, without stop strings, incremental detokenization."""
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        ids = self.validate_prompt(prompt)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, ids, child_params, self.eos_token_ids,
                          prompt=prompt if isinstance(prompt, str) else None, max_model_len=self.max_model_len)
            if child_params.prompt_logprobs is not None:
                req.read_prefix_cache = False   # prompt logprobs need every prompt position computed
            req.extras.update(extras or {})
            prepare_traced_request(req, params.n, self.runner)   # tracing: bind the plan, prefix-cache policy
            children.append(req)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, ids, params, children, stream)
        for req in children:
            self.scheduler.add_request(req)
            if req.extras.get(TRACE_KEY) is not None:
                self._traced.append(req)
                self.runner.trace_possible = True
            if not req.can_step_ahead:
                self._serial_only.append(req)

    def abort_request(self, request_id: str) -> None:
        children = self.outputs.children_of(request_id)
        if not children:
            return
        self._end_requests([c.request_id for c in children], RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.add(request_id)

    def _end_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests now (their blocks are freed). One that is in the in-flight step gets a token
        from it that update_from_output drops, since the request no longer runs."""
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs) or self._in_flight is not None

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step's tokens through to outputs; with async scheduling, launch the next step first.

        Serial: schedule N -> launch N -> collect N -> update -> outputs of N.
        Async:  schedule N+1 ahead and launch it (N's sampled ids feed it on the device) -> collect N
                (launched by the previous call) -> update -> outputs of N (detokenization, stop strings)
                while the device runs N+1. The host work of a step hides behind the device work of the next.
        Every call returns the outputs of the tokens it collected. A request that ends with N's token
        (EOS, a stop string, an abort) already has an N+1 token in flight: update_from_output drops it,
        so nothing past the end is ever reported; its blocks are freed at once.
        """
        touched: set[str] = set(self._pending_outputs)
        self._pending_outputs.clear()
        current, self._in_flight = self._in_flight, None
        if current is None:
            so = self._schedule()
            current = self._launch(so) if so is not None else None
        if current is not None and self._can_schedule_ahead(current):
            next_so = self._schedule(ahead=True)
            if next_so is not None:
                self._in_flight = self._launch(next_so)
                self.num_steps_ahead += 1
        if current is not None:
            so, ro = current.so, self._collect(current)
            generated_before = self.scheduler.total_generated_tokens
            changed = self.scheduler.update_from_output(so, ro, now=time.monotonic())
            self.num_discarded_tokens += len(ro.sampled_token_ids) - (
                self.scheduler.total_generated_tokens - generated_before)
            stopped = self.outputs.process_tokens(changed, ro)
            if stopped:
                self._end_requests(stopped, RequestStatus.FINISHED_STOPPED)
            if self._traced:
                finish_traced_requests(changed)   # tracing: stack the saves of finished traced requests
            touched |= self.outputs.parents_to_report(changed)
            if self._traced:
                self._traced = _still_unfinished(self._traced, self.scheduler.requests)
                self.runner.trace_possible = bool(self._traced)
        self.prompt_tokens_total = self.scheduler.total_prompt_tokens
        # Requests the scheduler ended on its own (e.g. they can never fit in the KV pool).
        touched |= self.outputs.parents_of(self.scheduler.drain_finished_unreported())
        return self.outputs.make_outputs(touched)

    def _can_schedule_ahead(self, current: _InFlight) -> bool:
        """Whether the next step may be launched before `current` is read back (async scheduling)."""
        if not self.async_scheduling or current.failed is not None or self.scheduler.ahead_blocked:
            return False
        # Requests that need their tokens on the host first (Request.can_step_ahead).
        self._serial_only = _still_unfinished(self._serial_only, self.scheduler.requests)
        return not self._serial_only

    def _schedule(self, ahead: bool = False) -> SchedulerOutput | None:
        """The next batch, or None when nothing runs. ahead=True: a step is still in flight."""
        so = self.scheduler.schedule(ahead)
        if so.is_empty:
            if so.finished_request_ids or so.preempted_request_ids:
                # No batch carries the news to the runner this step; free per-request state (hybrid models) now.
                self.runner.release_request_states(so.finished_request_ids | so.preempted_request_ids)
            return None
        self.num_steps += 1
        return so

    def _launch(self, so: SchedulerOutput) -> _InFlight:
        try:
            return _InFlight(so, self.runner.launch(so))
        except Exception as exc:  # one bad batch must not take the engine down
            return _InFlight(so, None, self._failed_step(so, exc))

    def _collect(self, in_flight: _InFlight) -> ModelRunnerOutput:
        if in_flight.failed is not None:
            return in_flight.failed
        try:
            return self.runner.collect(in_flight.launched)
        except Exception as exc:
            return self._failed_step(in_flight.so, exc)

    @staticmethod
    def _failed_step(so: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
        logger.error("model step failed; failing its %d requests:\n%s", so.num_reqs, traceback.format_exc())
        return ModelRunnerOutput(errors={r.request_id: f"{type(exc).__name__}: {exc}" for r in so.requests})

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_used_blocks=self.block_pool.num_used_blocks, num_total_blocks=self.num_blocks,
            kv_cache_usage=self.block_pool.usage,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.scheduler.total_generated_tokens,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_steps=self.num_steps)


def _still_unfinished(requests: list[Request], unfinished: dict[str, Request]) -> list[Request]:
    """`requests` without the finished ones: the same list when every one is still in the scheduler's
    table of unfinished requests (the usual case, checked with map() so the loop runs in C: a Python
    loop over a large traced batch costs ~0.1 ms a step)."""
    ids = map(operator.attrgetter("request_id"), requests)
    if all(map(operator.is_, map(unfinished.get, ids), requests)):
        return requests
    return [r for r in requests if not r.is_finished]


def _config_dtype(model_dir: str) -> torch.dtype | None:
    import json
    import os
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        name = cfg.get("dtype") or cfg.get("torch_dtype")
    except (OSError, ValueError):
        return None
    return getattr(torch, name, None) if isinstance(name, str) else None
