"""Executes one scheduled step: batch building, model forward, LM head, sampler, host readback."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from pellucid.attention.backend import AttentionBackend, get_backend_class
from pellucid.attention.metadata import ForwardContext, forward_context
from pellucid.config import EngineConfig
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.heads.registry import build_head
from pellucid.logger import get_logger
from pellucid.runner.batch import StepBatch, build_step_batch
from pellucid.runner.buffers import StepBuffers
from pellucid.runner.output import ModelRunnerOutput
from pellucid.runner.sampler import Sampler, gather_logprobs
from pellucid.runner.sampling_metadata_builder import build_sampling_metadata
from pellucid.runner.state_pool import RecurrentStatePool
from pellucid.tracing.hooks import StepTrace

logger = get_logger(__name__)


def choose_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    if name != "auto":
        return get_backend_class(name)
    if device.type == "cuda":
        try:
            return get_backend_class("triton")
        except ValueError:
            logger.warning("Triton attention backend unavailable; using the torch reference backend on %s", device)
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
        backend_cls = choose_backend(config.runner.attention_backend, device)
        self.backend = backend_cls(model.num_attention_heads, model.num_kv_heads, model.head_dim, dtype, device)
        self.head = build_head(config.head.name, model.lm_head.weight, config.head.options, config.model.model)
        self.sampler = Sampler()
        self.buffers = StepBuffers(max_num_batched_tokens, self.max_num_reqs,
                                   math.ceil(max_model_len / self.block_size), device)
        self.kv_caches: list[torch.Tensor] = []
        # Hybrid models (conv / SSM layers): per-request recurrent state next to the KV cache. Allocated
        # before KV sizing so GPU profiling counts it.
        self.state_pool = RecurrentStatePool.for_model(model, self.max_num_reqs, dtype, device)
        logger.info("attention backend: %s", self.backend.name)

    @property
    def supports_prefix_caching(self) -> bool:
        """False for models whose state cannot be rebuilt from cached KV blocks (hybrid models)."""
        return bool(getattr(self.model, "supports_prefix_caching", True))

    def release_request_states(self, request_ids: set[str]) -> None:
        """Free per-request state of finished/preempted requests when no batch runs to carry the news."""
        if self.state_pool is not None:
            self.state_pool.release(request_ids)

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * m.num_kv_heads * m.head_dim * elem * m.num_attention_layers

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        # More blocks than max_num_seqs full-length sequences need only serve the prefix cache.
        enough = self.max_num_reqs * math.ceil(self.max_model_len / self.block_size) + 1
        if self.device.type != "cuda":
            return max(min(cache.cpu_kv_cache_bytes // self.kv_bytes_per_block(), enough), 2)
        return self._profile_num_gpu_blocks(cache.gpu_memory_utilization)

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
        """A prefill of `num_tokens` tokens in one sequence with a throwaway single-block-per-token cache."""
        from pellucid.engine.request import Request
        from pellucid.sampling_params import SamplingParams

        bs = self.block_size
        nblocks = math.ceil(num_tokens / bs)
        saved = self.kv_caches
        self.allocate_kv_cache(nblocks)
        req = Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1))
        req.block_ids = list(range(nblocks))
        so = SchedulerOutput(requests=[req], num_scheduled_tokens=[num_tokens], num_computed_tokens=[0],
                             samples=[True])
        extras = self.state_pool.scratch_extras(1) if self.state_pool is not None else None
        self._forward(build_step_batch(so, self.buffers, bs), extras)
        self.kv_caches = saved

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(m.num_attention_layers)]

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = build_step_batch(so, self.buffers, self.block_size)
        extras = self.state_pool.prepare(so) if self.state_pool is not None else None
        # Tracing (pellucid/tracing/hooks.py): None unless a request in this batch is traced. A traced
        # step runs eagerly (no CUDA-graph replay) with hooks on the addressed modules for this forward only.
        trace = StepTrace.for_batch(so, batch, self.model)
        batch_is_traced = trace is not None
        with trace.hooks() if batch_is_traced else contextlib.nullcontext():
            hidden = self._forward(batch, extras)
        out = self._sample(batch, hidden, trace)
        if trace is not None:
            trace.finish_step(out)
        return out

    def _forward(self, batch: StepBatch, extras: dict[str, Any] | None = None) -> torch.Tensor:
        ctx = ForwardContext(attn_metadata=batch.attn, backend=self.backend,
                             backend_metadata=self.backend.build_metadata(batch.attn),
                             kv_caches=self.kv_caches, positions=batch.positions,
                             token_to_req=batch.token_to_req, extras=dict(extras or {}))
        with forward_context(ctx):
            return self.model(batch.input_ids)

    def _sample(self, batch: StepBatch, hidden: torch.Tensor, trace: StepTrace | None = None) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if trace is not None:
            trace.apply_logits_ops(self.head, hidden)   # `logits` site: exact logits, edits reach the sampler
        if batch.sample_requests:
            sampling = build_sampling_metadata(batch.sample_requests, self.device)
            if trace is None:
                result = self.head.sample(hidden[batch.sample_rows], sampling, self.sampler)
            else:
                result = trace.sample(self.head, self.sampler, hidden[batch.sample_rows], sampling)
                trace.record_tokens(result.sampled_token_ids)
            token_ids = result.sampled_token_ids.tolist()   # the step's one device-to-host read
            for req, tok in zip(batch.sample_requests, token_ids):
                out.sampled_token_ids[req.request_id] = tok
            if result.logprobs is not None:
                lp = result.logprobs
                ids, lps, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
                for row, req in enumerate(batch.sample_requests):
                    if req.sampling_params.logprobs is not None:
                        k = req.sampling_params.logprobs + 1
                        out.logprobs[req.request_id] = (ids[row][:k], lps[row][:k], ranks[row])
        for plr in batch.prompt_logprob_rows:
            k = plr.request.sampling_params.prompt_logprobs
            logits = self.head.compute_logits(hidden[torch.as_tensor(plr.rows, device=hidden.device)])
            targets = torch.tensor(plr.target_token_ids, device=hidden.device)
            lp = gather_logprobs(logits, targets, k)
            ids, lps, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
            out.prompt_logprobs[plr.request.request_id] = (plr.first_position,
                                                          [(ids[r], lps[r], ranks[r]) for r in range(len(ranks))])
        return out
