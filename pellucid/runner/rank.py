"""One rank's model, runner and KV cache, set up the same way in the engine core and in a tensor-parallel
worker: load the model (this rank's shard), resolve the step limits, build the runner, size and allocate
the KV cache (capturing CUDA graphs), and, under tensor parallelism, probe the traceable sites.

Under tensor parallelism every rank runs this sequence at the same time; each collective in it (the KV
pool size is the smallest any rank has room for, graph captures and site probes run the model) is met by
every rank, and a rank that cannot load its shard makes every rank raise a start-up error naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pellucid.config import EngineConfig, resolve_dtype
from pellucid.distributed.parallel_state import get_tensor_parallel
from pellucid.models.config_file import read_config_json
from pellucid.models.loader import load_model
from pellucid.runner.model_runner import ModelRunner

RunnerFactory = Callable[..., ModelRunner]


@dataclass
class RankSetup:
    device: torch.device
    model: nn.Module
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    runner: ModelRunner
    num_blocks: int


def build_rank(config: EngineConfig, device: torch.device, make_runner: RunnerFactory = ModelRunner) -> RankSetup:
    """This process's rank, ready to run steps. Resolves `config.scheduler.max_num_batched_tokens` when unset."""
    mc, sc = config.model, config.scheduler
    tp = get_tensor_parallel()

    def load() -> tuple[nn.Module, Any, int]:
        dtype = resolve_dtype(mc.dtype, str(device), config_dtype(mc.model))
        model, hf_config = load_model(mc.model, dtype, device, mc.max_model_len, mc.submodel, mc.hf_overrides)
        return model, hf_config, resolve_max_model_len(mc.max_model_len, hf_config)

    model, hf_config, max_model_len = load() if tp is None else tp.run_on_every_rank("loading the model", load)
    if sc.max_num_batched_tokens is None:
        sc.max_num_batched_tokens = min(max(2048, max_model_len), 8192) if sc.enable_chunked_prefill \
            else max_model_len
    dtype = next(model.parameters()).dtype
    runner = make_runner(config, model, hf_config, device, dtype, max_model_len, sc.max_num_batched_tokens)
    num_blocks = runner.determine_num_blocks()
    runner.allocate_kv_cache(num_blocks)
    if tp is not None:
        # The site probe runs the model: every rank now, together (later calls find it cached).
        from pellucid.tracing.sites import site_table
        site_table(runner)
    return RankSetup(device, model, hf_config, dtype, max_model_len, runner, num_blocks)


def start_rank(config: EngineConfig, device: torch.device) -> RankSetup:
    """The engine core's rank: the whole model at tensor_parallel_size 1; above it rank 0, set up after the
    other ranks were started (or, under torchrun, joined), with a runner that sends them every step."""
    if config.parallel.tensor_parallel_size == 1:
        return build_rank(config, device)
    from pellucid.distributed.driver import start_driver_rank
    return start_driver_rank(config, device)


def resolve_max_model_len(asked: int | None, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if asked is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return int(limit)
    if limit is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}")
    return asked


def config_dtype(model_dir: str) -> torch.dtype | None:
    """The checkpoint's dtype as config.json names it, if it does."""
    cfg = read_config_json(model_dir) or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None
