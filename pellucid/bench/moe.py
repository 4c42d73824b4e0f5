"""What a mixture-of-experts decode step must read, and what a prefill must compute.

A decode step of B tokens reads every non-expert weight once (attention, norms, routers, the LM head;
the input embedding only for an untied head's rows, as common.weight_bytes_per_step) plus the experts
the batch's tokens chose, once each however many tokens chose them. Which experts a batch touches is
measured, not assumed: a short traced run saves every sparse layer's routing decision
(`model.layers.i.mlp.routing`) at the generated positions, and the distinct experts per layer and step
are counted.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from pellucid.bench.common import random_prompts


def sparse_blocks(model: torch.nn.Module) -> list[tuple[int, Any]]:
    from pellucid.models.moe import SparseMoeBlock
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(sparse_blocks(model))


def expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of one expert of one layer, bytes of every expert of every layer)."""
    blocks = sparse_blocks(model)
    total = sum(p.numel() * p.element_size() for _, b in blocks for p in b.experts.parameters())
    experts = sum(b.spec.num_experts for _, b in blocks)
    return (total // experts if experts else 0), total


def decode_bytes(model: torch.nn.Module, dense_bytes: int, experts_touched: float) -> float:
    """Weight bytes of one decode step: `dense_bytes` (common.weight_bytes_per_step, all experts included)
    with the experts replaced by `experts_touched` distinct experts per sparse layer."""
    one, total = expert_bytes(model)
    return dense_bytes - total + experts_touched * one * len(sparse_blocks(model))


def measure_experts_touched(llm: Any, batch: int, input_len: int, steps: int, seed: int) -> float:
    """Mean distinct experts per sparse layer per decode step of `batch` requests at equal positions, on an
    LLM whose engine core runs in this process."""
    from pellucid.sampling_params import SamplingParams
    from pellucid.tracing import Save, TracePlan

    core = llm.engine
    layers = [i for i, _ in sparse_blocks(core.runner.model)]
    plan = [Save(site=f"model.layers.{i}.mlp.routing", name=str(i), phase="generated") for i in layers]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, detokenize=False)
    vocab = core.runner.head.vocab_size
    for r, prompt in enumerate(random_prompts([input_len] * batch, vocab, seed)):
        llm.add_request(f"touched-{batch}-{r}", prompt, params, extras={"trace": TracePlan(plan)})
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    counts = []
    for i in layers:
        chosen = torch.stack([o.extras["saves"][str(i)][:steps] != 0 for o in finished])   # [B, steps, E]
        counts += chosen.any(dim=0).sum(dim=-1).tolist()
    return statistics.mean(counts)


def moe_prefill_flops(model: torch.nn.Module, num_tokens: int) -> float:
    """Matmul FLOPs the experts add to common.prefill_flops (which counts 2D weights only): each token runs
    top_k experts of every sparse layer."""
    return sum(2.0 * num_tokens * b.spec.top_k * sum(p[0].numel() for p in b.experts.parameters())
               for _, b in sparse_blocks(model))
