"""Shared pieces of the benchmarks: engine construction, random prompts, byte and FLOP counts."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from pellucid.bench.models import resolve_model


def make_engine(args: argparse.Namespace, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                **extra: Any):
    """(an LLM with its engine core in this thread, stepped by hand: `llm.engine` is the core; model dir)."""
    from pellucid.config import EngineConfig
    from pellucid.llm import LLM

    model_dir = resolve_model(args.model, args.model_cache)
    config = EngineConfig.from_kwargs(model_dir, dtype="bfloat16", max_model_len=max_model_len,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                                      gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                                      kv_cache_dtype=args.kv_cache_dtype, **extra)
    return LLM.from_config(config), model_dir


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in lengths]


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step must read: every parameter once, except an untied input
    embedding, of which a step reads only its tokens' rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_kv_heads * model.head_dim * elem * model.num_attention_layers


def prefill_flops(model: torch.nn.Module, num_tokens: int) -> float:
    """Matmul FLOPs of one prompt: 2 * (non-embedding weights) per token, plus causal attention
    (QK^T and PV over half the square on average), plus the LM head for the last token only."""
    linear = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name)
    attn = 2 * 2 * model.num_attention_layers * model.num_attention_heads * model.head_dim * num_tokens * num_tokens / 2
    return 2.0 * linear * num_tokens + attn + 2.0 * model.lm_head.weight.numel()


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("| " + " | ".join("---" for _ in headers) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
