"""Executes one scheduled step: batch building, model forward, LM head, sampler, host readback."""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from pellucid.attention.backend import AttentionBackend, get_backend_class
from pellucid.attention.kv_dtype import resolve_kv_cache_dtype
from pellucid.models.kv_cache_scales import check_kv_cache_scales
from pellucid.attention.metadata import ForwardContext, forward_context
from pellucid.config import EngineConfig
from pellucid.distributed.parallel_state import get_tensor_parallel
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.heads.registry import build_head
from pellucid.logger import get_logger
from pellucid.runner.batch import StepBatch, build_step_batch
from pellucid.runner.buffers import StepBuffers
from pellucid.runner.cuda_graphs import DecodeCudaGraphs, default_graph_sizes, graphs_unavailable_reason
from pellucid.runner.output import ModelRunnerOutput
from pellucid.runner.sampler import Sampler, gather_logprobs, host_to_device
from pellucid.runner.sampling_metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from pellucid.sampling_params import SamplingParams
from pellucid.runner.sampling_metadata_builder import build_sampling_metadata
from pellucid.runner.state_pool import RecurrentStatePool
from pellucid.runner.step_hooks import StepHook
from pellucid.tracing.hooks import StepTrace
from pellucid.tracing.plan import TRACE_KEY
from pellucid.tracing.taps import TapRuntime

TRACE_EXTRAS_KEYS = frozenset({TRACE_KEY})

logger = get_logger(__name__)

_request_id = operator.attrgetter("request_id")
_sampling_params = operator.attrgetter("sampling_params")


# ---- launch / collect (begin) -----------------------------------------------------------------------
@dataclass
class LaunchedStep:
    """A step whose device work is queued (ModelRunner.launch) and whose results are not read yet.

    The tensors are host copies in flight (pinned, written by non-blocking copies on CUDA) or, on CPU, the
    results themselves; `ready` is the event after the last copy. Nothing here is read before collect().
    """

    sample_request_ids: list[str]
    logprobs_k: list[int | None]                    # per sampling row: asked logprobs (None: not asked)
    token_ids: torch.Tensor | None = None           # [rows] sampled ids
    logprobs: LogprobsTensors | None = None
    prompt_logprobs: list[tuple[str, int, LogprobsTensors]] = field(default_factory=list)
    trace: StepTrace | None = None
    ready: torch.cuda.Event | None = None
    hook_handles: list[tuple[StepHook, Any]] = field(default_factory=list)   # step hooks' (hook, handle)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """Start a device-to-host copy into pinned memory without waiting for it (CPU tensors pass through)."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(token_ids=_to_host(lp.token_ids), logprobs=_to_host(lp.logprobs), ranks=_to_host(lp.ranks))
# ---- launch / collect (end) -------------------------------------------------------------------------


def choose_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    if name != "auto":
        return get_backend_class(name)
    if device.type == "cuda":
        try:
            return get_backend_class("triton")
        except ValueError as exc:
            logger.warning("%s; using the slow torch reference backend on %s", exc, device)
    return get_backend_class("torch")


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config: Any, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.config = config
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_reqs = config.scheduler.max_num_seqs
        # Under tensor parallelism every rank runs this runner on the same steps (rank 0 in the engine core,
        # the others in pellucid.distributed.worker); only rank 0 reads the results back.
        self.tp = get_tensor_parallel()
        self.reads_results = self.tp is None or self.tp.is_driver
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
        check_kv_cache_scales(model, config.model.model, self.kv_dtype)
        backend_cls = choose_backend(config.runner.attention_backend, device)
        self.backend = backend_cls(model.num_attention_heads, model.num_kv_heads, model.head_dim, dtype, device,
                                   kv_cache_dtype=self.kv_dtype)
        # A model whose sampling is its own (Qwen3-Omni's talker: a frame of codes per row) makes its head.
        make_head = getattr(model, "make_lm_head", None)
        if make_head is not None:
            self.head = make_head(config.head.name)
        elif model.lm_head is None:     # a checkpoint without one (models/loader.py): the head that has none
            self.head = build_head("none", torch.empty(model.config.vocab_size, model.config.hidden_size,
                                                       device="meta"), {})
        else:
            self.head = build_head(config.head.name, model.lm_head.weight, config.head.options, config.model.model,
                                   vocab_shard=getattr(model.lm_head, "vocab_shard", None))
        self.sampler = Sampler()
        self.buffers = StepBuffers(max_num_batched_tokens, self.max_num_reqs,
                                   math.ceil(max_model_len / self.block_size), device)
        self.kv_caches: list[torch.Tensor] = []
        # Hybrid models (conv / SSM layers): per-request recurrent state next to the KV cache. Allocated
        # before KV sizing so GPU profiling counts it.
        self.state_pool = RecurrentStatePool.for_model(model, self.max_num_reqs, dtype, device)
        logger.info("attention backend: %s", self.backend.name)
        # ---- CUDA graphs (begin) ----
        self.cuda_graphs: DecodeCudaGraphs | None = None
        reason = graphs_unavailable_reason(device, config.runner.enforce_eager, self.backend,
                                           self.state_pool is not None)
        if reason is None:
            sizes = config.runner.cuda_graph_sizes or default_graph_sizes(min(self.max_num_reqs, max_num_batched_tokens))
            self.cuda_graphs = DecodeCudaGraphs(model, self.backend, self.buffers, self.block_size, max_model_len, sizes)
        elif device.type == "cuda":
            logger.info("CUDA graphs off: %s; every step runs eagerly", reason)
        # ---- CUDA graphs (end) ----
        self.tap_runtime = TapRuntime(max_num_batched_tokens, device)   # tracing taps' persistent buffers
        # False while no request the engine holds is traced: launch() then skips the per-request trace scan.
        self._trace_possible = True
        self._sampling_cache: tuple[list[SamplingParams], SamplingMetadata] | None = None
        # The last launched step's sampled ids (device) and their requests, in row order: a step launched
        # ahead of that step's readback takes its pending input ids from here (_feed_pending_tokens).
        self._last_sampled: tuple[torch.Tensor, list[Any]] | None = None
        self._last_sampled_by: LaunchedStep | None = None     # the step that set _last_sampled
        # Recorded after each step's host-to-device input copies: the pinned host buffers they read are
        # rewritten by the next step's batch building, which may run while that step is in flight.
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None
        self.step_hooks: list[StepHook] = []     # installed by engine features (runner/step_hooks.py)

    def add_step_hook(self, hook: StepHook) -> None:
        if hook not in self.step_hooks:
            self.step_hooks.append(hook)

    def remove_step_hook(self, hook: StepHook) -> None:
        if hook in self.step_hooks:
            self.step_hooks.remove(hook)

    @property
    def trace_possible(self) -> bool:
        return self._trace_possible

    @trace_possible.setter
    def trace_possible(self, possible: bool) -> None:
        self._trace_possible = possible
        if not possible:
            # The next launch would drop the last decode step's trace anyway (nothing is traced): drop it now,
            # with the finished requests and save logs it holds, instead of whenever the next step comes.
            self.tap_runtime.last_trace = None

    @property
    def num_graph_steps(self) -> int:
        """Steps that replayed a decode CUDA graph (EngineStats)."""
        return self.cuda_graphs.num_replays if self.cuda_graphs is not None else 0

    @property
    def supports_prefix_caching(self) -> bool:
        """False for models whose state cannot be rebuilt from cached KV blocks (hybrid models)."""
        return bool(getattr(self.model, "supports_prefix_caching", True))

    def set_fatal_handler(self, handler: Any) -> None:
        """`handler(reason)` is called from another thread once this runner can no longer run steps (a
        tensor-parallel worker died: pellucid.distributed.driver). A runner of one process never calls it."""

    def shutdown(self) -> None:
        """Stop what the runner started outside this process (tensor-parallel workers); nothing here."""

    def release_request_states(self, request_ids: set[str]) -> None:
        """Free per-request state of finished/preempted requests when no batch runs to carry the news."""
        if self.state_pool is not None:
            self.state_pool.release(request_ids)

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.block_size * m.num_kv_heads * m.head_dim * elem * m.num_attention_layers

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        # More blocks than max_num_seqs full-length sequences need only serve the prefix cache.
        enough = self.max_num_reqs * math.ceil(self.max_model_len / self.block_size) + 1
        if self.device.type != "cuda":
            blocks = max(min(cache.cpu_kv_cache_bytes // self.kv_bytes_per_block(), enough), 2)
        else:
            blocks = self._profile_num_gpu_blocks(cache.gpu_memory_utilization)
        # Every rank holds the same blocks (its heads of them): as many as the fullest rank has room for.
        return blocks if self.tp is None else self.tp.min_int(blocks)

    def _profile_num_gpu_blocks(self, utilization: float) -> int:
        """Run a forward at the token budget to find peak activation memory; the rest of the budget is KV."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self._dummy_forward(self.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * utilization - peak - (total - free - torch.cuda.memory_reserved(self.device))
        blocks = int(budget // self.kv_bytes_per_block())
        if blocks <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.2f} GiB, "
                               f"gpu_memory_utilization={utilization}); lower max_num_batched_tokens or raise it")
        return blocks

    def _dummy_forward(self, num_tokens: int) -> None:
        """A prefill of `num_tokens` tokens (split into sequences of at most max_model_len) on a throwaway
        cache, then the LM head over up to max_num_seqs rows: the peak activation memory of a step."""
        from pellucid.engine.request import Request
        from pellucid.sampling_params import SamplingParams

        bs = self.block_size
        seq_len = min(num_tokens, self.max_model_len)
        lengths = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        lengths = lengths[:self.max_num_reqs]
        saved = self.kv_caches
        self.kv_caches = self._new_kv_caches(sum(math.ceil(n / bs) for n in lengths))
        requests, next_block = [], 0
        for i, n in enumerate(lengths):
            req = Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1))
            req.block_ids = list(range(next_block, next_block + math.ceil(n / bs)))
            next_block += len(req.block_ids)
            requests.append(req)
        so = SchedulerOutput(requests=requests, num_scheduled_tokens=lengths, num_computed_tokens=[0] * len(lengths),
                             samples=[True] * len(lengths))
        extras = self.state_pool.scratch_extras(len(lengths)) if self.state_pool is not None else None
        hidden = self._forward(build_step_batch(so, self.buffers, bs), extras)
        rows = min(self.max_num_reqs, hidden.shape[0])
        if self.head.computes_logits:
            self.head.compute_logits(hidden[:rows]).softmax(dim=-1).sort(dim=-1)
        self.kv_caches = saved

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool, then capture the decode CUDA graphs over it (they bake its addresses)."""
        self.kv_caches = self._new_kv_caches(num_blocks)
        if self.cuda_graphs is not None:
            self.cuda_graphs.capture(self.kv_caches)
            self.head.capture_cuda_graphs(self.cuda_graphs.sizes)

    def _new_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(m.num_attention_layers)]

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish: launch() then collect()."""
        return self.collect(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Build the batch and queue the forward, LM head, sampler and result copies; on CUDA this returns
        while the device still computes. Nothing of the step is read back until collect()."""
        # ---- tracing + CUDA graphs (begin; pellucid/tracing/hooks.py) ----
        # `trace` is None unless a request in this batch is traced. A decode-only step replays a CUDA
        # graph padded to the next captured size (cuda_graphs.py says which steps cannot); a traced one
        # only when all its module ops are taps, with a graph variant captured with those taps.
        # Most steps trace nothing: the engine says so (trace_possible) and spares the per-request scan.
        if self.trace_possible:
            trace = StepTrace.for_step(so, self.model, self.tap_runtime)
        else:
            trace = self.tap_runtime.last_trace = None
        graph_key = trace.graph_key if trace is not None else ()
        graph_size = None
        # Before any host input is written: capturing a tap variant writes them too.
        self._wait_for_input_copies()
        if self.cuda_graphs is not None and graph_key is not None:
            graph_size = self.cuda_graphs.size_for(so, handled_extras_keys=TRACE_EXTRAS_KEYS if trace else ())
            if graph_size is not None and graph_key and not self.cuda_graphs.ensure_variant(
                    graph_size, graph_key, trace.capture_hooks, self.kv_caches):
                graph_size = None
        batch = build_step_batch(so, self.buffers, self.block_size, num_padded_tokens=graph_size,
                                 num_padded_reqs=graph_size)
        if self._inputs_copied is not None:
            self._inputs_copied.record()     # right after the step's one input copy (build_step_batch)
        if len(batch.pending_rows):
            self._feed_pending_tokens(so.requests, batch)
        extras = self.state_pool.prepare(so) if self.state_pool is not None else None
        for hook in self.step_hooks:
            hook_extras = hook.before_forward(so, batch)
            if hook_extras:
                extras = {**(extras or {}), **hook_extras}
        if trace is not None:
            trace.prepare(batch.num_padded_tokens, graph=graph_size is not None)
        if graph_size is not None:
            hidden = self.cuda_graphs.replay(graph_size, graph_key, extras, max_seq_len=batch.attn.max_seq_len)
            if trace is not None:
                trace.after_replay()
        else:
            with trace.hooks() if trace is not None else contextlib.nullcontext():
                hidden = self._forward(batch, extras)
        # ---- tracing + CUDA graphs (end) ----
        step, sampled = self._launch_sampling(batch, hidden, trace)
        for hook in self.step_hooks:
            step.hook_handles.append((hook, hook.after_sampling(so, batch, hidden, sampled)))
        if hidden.device.type == "cuda":
            step.ready = torch.cuda.Event()     # after every copy to the host this step queued
            step.ready.record()
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for the step's results and read them: the step's one device-to-host read."""
        out = ModelRunnerOutput()
        with self._device_readback():
            if step.ready is not None:
                step.ready.synchronize()
            token_ids = step.token_ids.tolist() if step.token_ids is not None else []
            # Logprobs stay arrays (views of this step's own host copies): no Python object per value here;
            # the frontend makes them into Logprob objects.
            lp = step.logprobs
            if lp is not None:
                ids, lps, ranks = lp.token_ids.numpy(), lp.logprobs.numpy(), lp.ranks.numpy()
            prompt_lps = [(rid, first, p.token_ids.numpy(), p.logprobs.numpy(), p.ranks.numpy())
                          for rid, first, p in step.prompt_logprobs]
        out.sampled_token_ids = dict(zip(step.sample_request_ids, token_ids))
        if lp is not None:
            for row, (rid, k) in enumerate(zip(step.sample_request_ids, step.logprobs_k)):
                if k is not None:
                    out.logprobs[rid] = (ids[row, :k + 1], lps[row, :k + 1], int(ranks[row]))
        for rid, first, p_ids, p_lps, p_ranks in prompt_lps:
            out.prompt_logprobs[rid] = (first, (p_ids, p_lps, p_ranks))
        if step.trace is not None:
            step.trace.finish_step(out)
        for hook, handle in step.hook_handles:
            hook.after_readback(handle)
        if step is self._last_sampled_by:
            # No step was launched after this one, so the next is scheduled with every token on the host and
            # none pending: its sampled ids are not needed, nor its requests (finished ones among them) kept.
            self._last_sampled = self._last_sampled_by = None
        return out

    def retire(self, step: LaunchedStep) -> None:
        """A tensor-parallel worker's end of a step: what collect() does besides reading the results, which
        only rank 0 reads (the trace's step bookkeeping; its failures are rank 0's to report)."""
        if step.trace is not None:
            step.trace.finish_step(ModelRunnerOutput())
        if step is self._last_sampled_by:
            self._last_sampled = self._last_sampled_by = None

    def _wait_for_input_copies(self) -> None:
        """Before the pinned host staging region (and the block table in it) is rewritten, the previous
        step's copy out of it must be done. It is queued first in that step, so by now it almost always is
        (query, no wait)."""
        copied = self._inputs_copied
        if copied is not None and not copied.query():
            with self._device_readback():
                copied.synchronize()

    def _feed_pending_tokens(self, requests: list[Any], batch: StepBatch) -> None:
        """Copy, on the device, the ids sampled by the previous launched step into this step's input ids
        at the tokens the host does not know yet (a step scheduled ahead of the previous one's readback)."""
        if self._last_sampled is None:
            raise RuntimeError("a scheduled token is pending, but no launched step sampled it")
        sampled, sampled_requests = self._last_sampled
        pending = [requests[i] for i in batch.pending_rows.tolist()]
        input_ids = batch.input_ids     # this step's device view (staging.py), where its copy put the ids
        count = len(pending)
        in_order = (count <= len(sampled_requests) and all(map(operator.is_, pending, sampled_requests))
                    and batch.pending_token_index[-1] == count - 1)
        if in_order:
            # A steady decode batch: the same requests in the same rows as the step before.
            input_ids[:count].copy_(sampled[:count], non_blocking=True)
            return
        row_of = {id(r): row for row, r in enumerate(sampled_requests)}
        try:
            source = [row_of[id(r)] for r in pending]
        except KeyError as exc:
            raise RuntimeError("a pending token's request was not sampled by the previous launched step") from exc
        source_rows = host_to_device(source, torch.int64, self.device)
        target_rows = host_to_device(batch.pending_token_index.tolist(), torch.int64, self.device)
        input_ids.index_copy_(0, target_rows, sampled.index_select(0, source_rows).to(input_ids.dtype))

    @contextlib.contextmanager
    def _device_readback(self) -> Iterator[None]:
        """Marks the step's device-to-host reads (sampled ids, logprobs): the only syncs of a step.

        Under torch.cuda.set_sync_debug_mode (tests/gpu/test_no_sync.py) every other sync in the step
        raises; this block lifts the mode for the intended reads only.
        """
        mode = torch.cuda.get_sync_debug_mode() if self.device.type == "cuda" else 0
        if mode:
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            if mode:
                torch.cuda.set_sync_debug_mode(mode)

    def _forward(self, batch: StepBatch, extras: dict[str, Any] | None = None) -> torch.Tensor:
        ctx = ForwardContext(attn_metadata=batch.attn, backend=self.backend,
                             backend_metadata=self.backend.build_metadata(batch.attn),
                             kv_caches=self.kv_caches, positions=batch.positions,
                             token_to_req=batch.token_to_req, extras=dict(extras or {}))
        with forward_context(ctx):
            return self.model(batch.input_ids)

    def _sampling_metadata(self, requests: list[Any]) -> SamplingMetadata:
        """This step's SamplingMetadata; the previous step's when its rows carry the same SamplingParams
        objects in the same order and nothing in it depends on a request's progress (penalty histories,
        min_tokens bans, seeded generators, grammar masks), as in a steady decode batch."""
        params = list(map(_sampling_params, requests))
        cached = self._sampling_cache
        if cached is not None and len(cached[0]) == len(params) and all(map(operator.is_, cached[0], params)):
            return cached[1]
        sampling = build_sampling_metadata(requests, self.device)
        static = all(p.min_tokens == 0 and not p.needs_penalties and (p.greedy or p.seed is None)
                     and p.structured_outputs is None
                     for p in {id(p): p for p in params}.values())
        self._sampling_cache = (params, sampling) if static else None
        return sampling

    def _launch_sampling(self, batch: StepBatch, hidden: torch.Tensor, trace: StepTrace | None
                         ) -> tuple[LaunchedStep, SamplerOutput | None]:
        """Queue LM head + sampler (and prompt logprobs) and the copies of their results to the host."""
        requests = batch.sample_requests
        step = LaunchedStep(list(map(_request_id, requests)), [], trace=trace)
        result = None
        self._last_sampled = self._last_sampled_by = None
        if trace is not None:
            trace.apply_logits_ops(self.head, hidden)   # `logits` site: exact logits, edits reach the sampler
        if requests:
            sampling = self._sampling_metadata(requests)
            if batch.sample_rows_are_leading:     # a decode step: a view, no gather kernel
                sample_hidden = hidden[:len(requests)]
            else:
                sample_hidden = hidden.index_select(0, batch.sample_rows)   # index_select: no bounds sync
            if trace is None:
                result = self.head.sample(sample_hidden, sampling, self.sampler)
            else:
                result = trace.sample(self.head, self.sampler, sample_hidden, sampling)
                trace.record_tokens(result.sampled_token_ids)
            sampled = result.sampled_token_ids
            if self.tp is not None:
                # Every rank sampled (the head's collectives need every rank); rank 0's tokens are the step's,
                # and every rank's next input ids.
                sampled = self.tp.broadcast(sampled.contiguous())
            self._last_sampled = (sampled, requests)
            self._last_sampled_by = step
            if self.reads_results:
                step.token_ids = _to_host(sampled)
                if result.logprobs is not None:
                    step.logprobs = _logprobs_to_host(result.logprobs)
                    step.logprobs_k = [r.sampling_params.logprobs for r in requests]
        for plr in batch.prompt_logprob_rows:
            k = plr.request.sampling_params.prompt_logprobs
            rows = host_to_device(plr.rows.tolist(), torch.int64, hidden.device)
            logits = self.head.compute_logits(hidden.index_select(0, rows))
            targets = host_to_device(plr.target_token_ids, torch.int64, hidden.device)
            lps = gather_logprobs(logits, targets, k)
            if self.reads_results:
                step.prompt_logprobs.append((plr.request.request_id, plr.first_position, _logprobs_to_host(lps)))
        return step, result
