"""The engine core: token-id requests in, one step at a time, token-id outputs out.

It owns the model, the KV cache, the scheduler and the request features; it knows nothing of text.
The frontends (LLM, AsyncLLM, the server) reach it through an EngineCoreClient (core_client.py), in
their own process or in the engine-core process (core_proc.py), with the messages of messages.py.
"""
from __future__ import annotations

import os
import queue
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import pellucid
from pellucid.config import EngineConfig, resolve_device
from pellucid.engine.block_pool import BlockPool
from pellucid.engine.features import ActiveFeatures, check_served_without_logits, still_unfinished
from pellucid.engine.kv_cache_manager import KVCacheManager
from pellucid.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from pellucid.engine.request import Request, RequestStatus
from pellucid.engine.scheduler import Scheduler
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.logger import get_logger
from pellucid.models.loader import read_eos_token_ids
from pellucid.runner.model_runner import LaunchedStep
from pellucid.runner.output import ModelRunnerOutput
from pellucid.runner.rank import start_rank
from pellucid.sampling_params import SamplingParams
from pellucid.structured.matcher import matcher_for

logger = get_logger(__name__)

_RUNNING = RequestStatus.RUNNING


@dataclass
class _InFlight:
    """A scheduled step whose device work was launched and whose results are not collected yet."""

    so: SchedulerOutput
    launched: LaunchedStep | None
    failed: ModelRunnerOutput | None = None   # the errors of a step whose launch raised


@dataclass
class EngineInfo:
    """What an engine core publishes about itself once it is up (fixed for its life): what the frontends
    need to check requests before sending them, and the facts of the start-up banner."""

    version: str
    model: str                       # the model directory
    tokenizer: str                   # the tokenizer directory
    model_name: str                  # the served name
    architecture: str
    dtype: str
    device: str
    pid: int
    max_model_len: int
    vocab_size: int                  # the LM head's rows: valid token ids are [0, vocab_size)
    num_hidden_layers: int
    hidden_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    async_scheduling: bool
    attention_backend: str
    cuda_graphs: bool
    lm_head: dict[str, Any]
    tensor_parallel_size: int = 1
    max_logprobs: int = 20           # most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary)
    eos_token_ids: tuple[int, ...] = ()   # the ids that end a sequence (their text is not shown)
    computes_logits: bool = True     # False without an LM head: only requests that discard their tokens
    num_labels: int | None = None    # a sequence-classification model's classes (None: it has no `score` head)
    hf_overrides: dict[str, Any] | None = None   # set on config.json as it was read (frontends read it alike)
    # The decoder's module path: "model" (model.layers.N), or a stage's (Qwen3-Omni's thinker: "thinker.model").
    backbone: str = "model"
    # The traceable sites (pellucid.tracing.sites.SiteTable). In the engine's own process it is probed on
    # first use (a tiny forward); an engine in another process probes it before publishing its info.
    site_table_loader: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    _site_table: Any = field(default=None, repr=False, compare=False)

    @property
    def site_table(self) -> Any:
        if self._site_table is None:
            if self.site_table_loader is None:
                raise RuntimeError("this engine info carries no site table")
            self._site_table = self.site_table_loader()
        return self._site_table

    def features(self) -> dict[str, Any]:
        """The banner's feature list."""
        return {"prefix_caching": self.enable_prefix_caching, "chunked_prefill": self.enable_chunked_prefill,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "async_scheduling": self.async_scheduling, "attention_backend": self.attention_backend,
                "cuda_graphs": self.cuda_graphs, "lm_head": self.lm_head,
                "tensor_parallel_size": self.tensor_parallel_size}


class EngineCore:
    # Methods a frontend may call through EngineCoreClient.call_utility (by name; arguments and results
    # are plain data: what msgpack carries as it is). Features add theirs as "<key>.<name>".
    UTILITIES = frozenset({"reset_prefix_cache"})

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        torch.manual_seed(mc.seed)
        # The model, its runner and KV cache; under tensor parallelism rank 0's shard of them, whose runner
        # sends every step to the worker processes of the other ranks (pellucid/distributed).
        rank = start_rank(config, torch.device(resolve_device(config.runner.device)))
        self.device, self.model, self.hf_config, self.dtype = rank.device, rank.model, rank.hf_config, rank.dtype
        self.max_model_len, self.runner, self.num_blocks = rank.max_model_len, rank.runner, rank.num_blocks
        self.model_name = mc.served_model_name or mc.model
        sc = config.scheduler
        # A model whose vocabulary is not the tokenizer's (a pipeline stage's codec tokens) names its own EOS ids.
        model_eos = getattr(self.model, "eos_token_ids", None)
        self.eos_token_ids = set(model_eos) if model_eos is not None else \
            _eos_token_ids(mc.model, mc.tokenizer_dir, self.hf_config)
        self._resolve_prefix_caching()
        self.block_pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sc, config.cache, self.kv_manager, self.max_model_len)
        self.features = ActiveFeatures(self)
        self._pending: dict[str, Request] = {}    # ended outside a step (abort, stop), not reported yet
        self._refused: list[EngineCoreOutput] = []   # requests add_request refused (refuse())
        # Finished requests whose final report waits for a feature's Future (EngineFeature.after_step),
        # and those whose futures completed (filled from other threads).
        self._deferred: dict[str, Request] = {}
        self._deferred_done: queue.SimpleQueue[str] = queue.SimpleQueue()
        # Called (from any thread) when work appears that no input announced: a deferred output became
        # ready. The loop that runs this core sets it to wake itself up.
        self.wake: Callable[[], None] = lambda: None
        if sc.async_scheduling is None:
            sc.async_scheduling = self.device.type == "cuda"
        self.async_scheduling = sc.async_scheduling
        self._in_flight: _InFlight | None = None  # the step launched ahead (async scheduling)
        self._serial_only: list[Request] = []    # unfinished requests that cannot step ahead (can_step_ahead)
        self.num_discarded_tokens = 0            # in-flight tokens of requests that ended before them
        self.num_steps_ahead = 0                 # steps launched before the previous one was read back
        self.num_step_failures = 0
        self.num_aborted = 0
        self.num_requests_added = 0
        self.num_requests_refused = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        logger.info("engine ready: model=%s dtype=%s device=%s max_model_len=%d KV cache: %d blocks x %d tokens "
                    "= %d tokens in %s; prefix caching %s, chunked prefill %s (budget %d tokens/step)",
                    mc.model, str(self.dtype).removeprefix("torch."), self.device, self.max_model_len,
                    self.num_blocks, config.cache.block_size, self.num_blocks * config.cache.block_size,
                    str(self.runner.kv_dtype).removeprefix("torch."),
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
            reason = getattr(self.model, "no_prefix_caching_reason", None) or (
                f"{arch} keeps per-request recurrent state that cached attention KV cannot restore, "
                "so every request computes its prompt from the start")
            if asked:
                logger.warning("enable_prefix_caching=True was asked for, but prefix caching is off: %s", reason)
            else:
                logger.info("prefix caching off: %s", reason)
        cache.enable_prefix_caching = supported and asked is not False
    # ---- prefix caching vs hybrid models (end) ---------------------------------------------------

    def info(self, probe_sites: bool = False) -> EngineInfo:
        """The engine's published facts; `probe_sites` probes the site table now (for another process)."""
        from pellucid.tracing.sites import site_table

        config, sc = self.config, self.config.scheduler
        info = EngineInfo(
            version=pellucid.__version__, model=config.model.model,
            tokenizer=config.model.tokenizer_dir, model_name=self.model_name,
            architecture=type(self.model).__name__, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), pid=os.getpid(), max_model_len=self.max_model_len,
            vocab_size=self.runner.head.vocab_size, num_hidden_layers=int(self.hf_config.num_hidden_layers),
            hidden_size=int(self.hf_config.hidden_size), num_blocks=self.num_blocks,
            block_size=config.cache.block_size, max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens, enable_chunked_prefill=sc.enable_chunked_prefill,
            enable_prefix_caching=bool(config.cache.enable_prefix_caching), async_scheduling=self.async_scheduling,
            attention_backend=self.runner.backend.name, cuda_graphs=self.runner.cuda_graphs is not None,
            lm_head=self.runner.head.describe(), tensor_parallel_size=config.parallel.tensor_parallel_size,
            max_logprobs=config.model.max_logprobs, backbone=getattr(self.model, "backbone_path", "model"),
            eos_token_ids=tuple(sorted(self.eos_token_ids)), computes_logits=self.runner.head.computes_logits,
            num_labels=getattr(self.model, "num_labels", None), hf_overrides=config.model.hf_overrides)
        if probe_sites:
            info._site_table = site_table(self.runner)
        else:
            info.site_table_loader = lambda: site_table(self.runner)
        return info

    # ---- requests -------------------------------------------------------------------------------
    def check_prompt_ids(self, ids: list[int]) -> None:
        """ValueError naming what is wrong with a prompt's token ids (the frontend checks the same first)."""
        check_prompt_ids(ids, self.runner.head.vocab_size, self.max_model_len,
                         self.config.scheduler.enable_chunked_prefill, self.config.scheduler.max_num_batched_tokens)
        model_check = getattr(self.model, "check_prompt_ids", None)    # a model that reads only some ids
        if model_check is not None:
            model_check(ids)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (nothing queued) when it cannot run."""
        rid = request.request_id
        if rid in self.scheduler.requests or rid in self._pending:
            raise ValueError(f"request id {rid!r} is already in use")
        params = request.params
        params.validate()
        if params.n != 1:
            raise ValueError(f"the engine core runs one sequence per request (got n={params.n}); the frontend "
                             "fans n > 1 out")
        self.check_prompt_ids(request.prompt_token_ids)
        check_sampling_token_ids(params, self.runner.head.vocab_size)
        check_served_without_logits(request.extras, self.runner.head.computes_logits)
        missing = [key for key in getattr(self.model, "required_extras", ()) if key not in (request.extras or {})]
        if missing:
            raise ValueError(f"{type(self.model).__name__} serves requests carrying {', '.join(missing)} only (a "
                             "pipeline stage whose inputs come from the previous stage: serve it as a pipeline)")
        req = Request(rid, request.prompt_token_ids, params, self.eos_token_ids,
                      arrival_time=request.arrival_time, max_model_len=self.max_model_len)
        req.stream_outputs = request.stream
        if params.structured_outputs is not None:
            req.grammar = matcher_for(params, self.config.model.tokenizer_dir,
                                      self.runner.head.vocab_size, req.eos_token_ids)
        if params.prompt_logprobs is not None:
            req.read_prefix_cache = False   # prompt logprobs need every prompt position computed
        if request.extras:
            req.extras.update(request.extras)
            self.features.prepare(req)
        self.scheduler.add_request(req)
        if req.extras:
            self.features.queued(req)
        if not req.can_step_ahead:
            self._serial_only.append(req)
        self.num_requests_added += 1

    def refuse(self, request: EngineCoreRequest, error: str) -> None:
        """Report a request that add_request refused as failed, in the next step's outputs (for frontends
        that do not wait for add_request's ValueError: an engine in another process)."""
        self._refused.append(EngineCoreOutput(request.request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value,
                                              error=error))
        self.num_requests_refused += 1

    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        num_output_tokens: list[int] | None = None) -> None:
        """End requests now (their blocks are freed); `reason` "stop": a stop string the frontend found
        completed at `num_output_tokens[i]` output tokens. One that is in the in-flight step gets a token
        from it that update_from_output drops, since the request no longer runs."""
        status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_ABORTED
        ended = []
        for i, rid in enumerate(request_ids):
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if num_output_tokens is not None:
                req.truncate_output(num_output_tokens[i])
            ended.append(req)
        self.scheduler.finish_requests([r.request_id for r in ended], status)
        if status is RequestStatus.FINISHED_ABORTED:
            self.num_aborted += len(ended)
        self.features.after_finish(ended)
        for req in ended:
            self._pending[req.request_id] = req

    def fail_requests(self, request_ids: list[str], error: str) -> None:
        """End requests now with `error` (a feature found their inputs broken); unknown ids are ignored."""
        ended = [self.scheduler.requests[rid] for rid in request_ids if rid in self.scheduler.requests]
        self.scheduler.finish_requests([r.request_id for r in ended], RequestStatus.FINISHED_ERROR)
        for req in ended:
            req.error = error
            self._pending[req.request_id] = req
        self.features.after_finish(ended)

    def abort_all(self, error: str | None = None) -> None:
        """End every unfinished request (shutdown, a failed step): aborted, or failed with `error`."""
        ids = list(self.scheduler.requests)
        if error is None:
            self.finish_requests(ids)
            return
        self.fail_requests(ids, error)

    def has_unfinished_requests(self) -> bool:
        """Whether a step() now would do or report anything (requests that wait for a pipeline stage's
        inputs do not count: they wait without steps)."""
        return (self.scheduler.has_runnable_requests() or bool(self._pending) or bool(self._refused)
                or self._in_flight is not None or not self._deferred_done.empty())

    def has_deferred_outputs(self) -> bool:
        """Finished requests whose final report waits for work off the step loop (a file being written)."""
        return bool(self._deferred)

    def wait_deferred(self, timeout: float | None = None) -> None:
        """Block until a deferred output is ready (or `timeout` passed); for a caller that steps this core."""
        try:
            rid = self._deferred_done.get(timeout=timeout)
        except queue.Empty:
            return
        self._deferred_done.put(rid)

    def utility(self, name: str) -> Callable[..., Any]:
        """The utility method called `name`: an EngineCore one, or a feature's "<key>.<name>"."""
        if name in self.UTILITIES:
            return getattr(self, name)
        key, dot, method = name.partition(".")
        if not dot:
            raise ValueError(f"{name!r} is not an engine utility (known: {', '.join(sorted(self.UTILITIES))}, "
                             "or a feature's '<key>.<name>')")
        return self.features.utility(key, method)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one step's tokens through to outputs; with async scheduling, launch the next step first.

        Serial: schedule N -> launch N -> collect N -> update -> outputs of N.
        Async:  schedule N+1 ahead and launch it (N's sampled ids feed it on the device) -> collect N
                (launched by the previous call) -> update -> outputs of N while the device runs N+1.
        Every call returns the outputs of the tokens it collected, plus requests that ended outside a step.
        A request that ends with N's token (EOS, a stop string, an abort) already has an N+1 token in
        flight: update_from_output drops it, so nothing past the end is ever reported.
        """
        started = time.perf_counter()
        outputs: list[EngineCoreOutput] = []
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
            changed = self.scheduler.update_from_output(so, ro)
            self.num_discarded_tokens += len(ro.sampled_token_ids) - (
                self.scheduler.total_generated_tokens - generated_before)
            self.features.after_step(changed)
            make = self._output
            outputs = [make(req, ro) for req in changed if req.stream_outputs or req.status is not _RUNNING]
            if ro.prompt_logprobs:
                # A prompt chunk that samples nothing still scored its positions: report them too.
                reported = {out.request_id for out in outputs}
                outputs += [make(req, ro) for req in so.requests
                            if req.request_id in ro.prompt_logprobs and req.request_id not in reported]
            if self._deferred:
                outputs = [out for out in outputs if out is not None]
        outputs = self._with_pending(outputs)
        self.step_seconds += time.perf_counter() - started
        return EngineCoreOutputs(outputs)

    def _with_pending(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """`outputs` plus the requests that ended outside the step and have not been reported."""
        while not self._deferred_done.empty():
            req = self._deferred.pop(self._deferred_done.get())
            self._pending[req.request_id] = req
        # Requests the scheduler ended on its own (e.g. they can never fit in the KV pool).
        for req in self.scheduler.drain_finished_unreported():
            self._pending[req.request_id] = req
        if self._pending:
            reported = {out.request_id for out in outputs}
            pending = [self._output(req, None) for rid, req in self._pending.items() if rid not in reported]
            outputs.extend(out for out in pending if out is not None)
            self._pending.clear()
        if self._refused:
            outputs.extend(self._refused)
            self._refused.clear()
        return outputs

    def fail_in_flight(self, error: str) -> EngineCoreOutputs:
        """After a fault outside the per-step error handling: drop the step in flight, fail every
        unfinished request with `error`, and return their final outputs."""
        self._in_flight = None
        self.num_step_failures += 1
        self.abort_all(error)
        return EngineCoreOutputs(self._with_pending([]))

    def _output(self, req: Request, ro: ModelRunnerOutput | None) -> EngineCoreOutput | None:
        """A request's news: the tokens it has not reported yet, their logprobs, and how it ended. None for
        a finished request whose final report waits for a feature's Future (reported once it is done)."""
        if req.feature_outputs and req.status is not _RUNNING and self._defer(req):
            return None
        tokens = req.output_token_ids
        reported = req.num_reported_tokens
        new = tokens[reported:] if reported else list(tokens)
        req.num_reported_tokens = len(tokens)
        out = EngineCoreOutput(req.request_id, new, num_cached_tokens=max(req.num_cached_tokens, 0))
        if req.events:
            out.events, req.events = req.events, None
        if ro is not None:
            rid = req.request_id
            if ro.logprobs and rid in ro.logprobs and new:
                out.new_logprobs = [ro.logprobs[rid]]
            if ro.prompt_logprobs and rid in ro.prompt_logprobs:
                out.prompt_logprobs = ro.prompt_logprobs[rid]
        if req.status is not _RUNNING and req.status.finished:
            out.finish_reason = req.status.value
            out.stop_reason = req.stop_reason
            out.error = req.error
            out.bad_request = req.bad_request
            # The output becomes the only owner of the feature outputs: finished requests stay referenced
            # by engine internals for a while (persistent batch rows, the last step's trace).
            out.extras, req.feature_outputs = req.feature_outputs, None
        return out

    def _defer(self, req: Request) -> bool:
        """Hold a finished request's final report while any of its feature outputs is a Future still
        running; resolve the finished ones into their values (a failed one into {"error": ...})."""
        outputs = req.feature_outputs
        waiting = [f for f in outputs.values() if isinstance(f, Future) and not f.done()]
        if waiting:
            if req.request_id not in self._deferred:
                self._deferred[req.request_id] = req
                remaining = [len(waiting)]

                def one_done(_future: Future) -> None:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        self._deferred_done.put(req.request_id)
                        self.wake()
                for future in waiting:
                    future.add_done_callback(one_done)
            return True
        for key, value in outputs.items():
            if isinstance(value, Future):
                error = value.exception()
                outputs[key] = {"error": f"{type(error).__name__}: {error}"} if error else value.result()
        return False

    def _can_schedule_ahead(self, current: _InFlight) -> bool:
        """Whether the next step may be launched before `current` is read back (async scheduling)."""
        if not self.async_scheduling or current.failed is not None or self.scheduler.ahead_blocked:
            return False
        # Requests that need their tokens on the host first (Request.can_step_ahead).
        self._serial_only = still_unfinished(self._serial_only, self.scheduler.requests)
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

    def _failed_step(self, so: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
        self.num_step_failures += 1
        logger.error("model step failed; failing its %d requests:\n%s", so.num_reqs, traceback.format_exc())
        return ModelRunnerOutput(errors={r.request_id: f"{type(exc).__name__}: {exc}" for r in so.requests})

    # ---- utilities (EngineCoreClient.call_utility) -------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_used_blocks=self.block_pool.num_used_blocks, num_total_blocks=self.num_blocks,
            kv_cache_usage=self.block_pool.usage,
            prompt_tokens_total=s.total_prompt_tokens, generation_tokens_total=s.total_generated_tokens,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_steps=self.num_steps, step_seconds=self.step_seconds, num_steps_ahead=self.num_steps_ahead,
            num_graph_steps=self.runner.num_graph_steps, num_step_failures=self.num_step_failures,
            num_aborted=self.num_aborted,
            num_requests_added=self.num_requests_added, num_requests_refused=self.num_requests_refused,
            lm_head_usage=self.runner.head.usage())

    # ---- processes beside the core (tensor-parallel workers) -----------------------------------------
    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        """`handler(reason)` is called from another thread when the engine can no longer run (a
        tensor-parallel worker died); the process hosting the core reports it and exits."""
        self.runner.set_fatal_handler(handler)

    def shutdown(self) -> None:
        """Stop the processes the core started (tensor-parallel workers); the core is unusable after."""
        self.runner.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use (vLLM's reset_prefix_cache); returns how many."""
        return self.block_pool.reset_prefix_cache()


def build_core(config: EngineConfig) -> Any:
    """The engine core of `config`: an EngineCore, or the class `config.core` names ("module:Class", a
    pipeline stage's own core speaking the same protocol)."""
    if config.core is None:
        return EngineCore(config)
    import importlib
    module, _, name = config.core.partition(":")
    try:
        core_class = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine core {config.core!r} cannot be imported: {exc}") from exc
    return core_class(config)


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, chunked_prefill: bool,
                     max_num_batched_tokens: int) -> None:
    """ValueError naming what is wrong with a prompt's token ids for an engine with these limits."""
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room for output within "
                         f"max_model_len={max_model_len}")
    if not chunked_prefill and len(ids) > max_num_batched_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                         f"{max_num_batched_tokens} with chunked prefill disabled")


def check_sampling_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the sampling field that names a token outside the vocabulary (the sampler indexes the
    logits by these ids: on a GPU an index past the vocabulary would take the whole engine down)."""
    for name, ids in params.token_ids_named().items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _eos_token_ids(model_dir: str, tokenizer_dir: str, hf_config: Any) -> set[int]:
    """The checkpoint's EOS ids (generation_config.json, else config.json) plus the tokenizer's eos token. The
    engine core keeps only the ids, but finds the token's id by loading the tokenizer (transformers resolves the
    eos token from several files and class defaults)."""
    ids = read_eos_token_ids(model_dir, hf_config)
    eos = _tokenizer_eos_id(tokenizer_dir)
    if eos is not None:
        ids.add(eos)
    return ids


def _tokenizer_eos_id(tokenizer_dir: str) -> int | None:
    from pellucid.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir).eos_token_id
