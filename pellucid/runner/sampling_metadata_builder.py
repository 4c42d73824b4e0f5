"""Builds one step's SamplingMetadata from the Requests that sample, in batch order.

Per-row parameters are packed into one host tensor (pinned when the device is CUDA) and sent with a
single non-blocking copy; the stage flags are computed on the host so the sampler can skip stages.
"""
from __future__ import annotations

import torch

from pellucid.engine.request import Request
from pellucid.runner.sampling_metadata import SamplingMetadata
from pellucid.sampling_params import SamplingParams
from pellucid.structured.matcher import fill_bitmasks

# Rows of the packed parameter tensor. top_k travels as float32, capped at 2**24 where float32 is still
# exact: a larger k exceeds every vocabulary, so it means "no cut" either way.
_PACKED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")


def _step_seed(request: Request) -> int:
    """This step's seed of a seeded row: one draw from the request's CPU generator per step it samples, so
    it depends only on the request's seed and how many tokens it has sampled, whatever the row's draws."""
    assert request.generator is not None
    return int(torch.randint(0, 2**62, (1,), generator=request.generator))


def _banned_token_ids(request: Request) -> list[int]:
    """EOS and stop token ids stay masked until the request has produced min_tokens tokens."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    return sorted(request.eos_token_ids | set(params.stop_token_ids))


def _packed_row(params: SamplingParams) -> tuple[float, ...]:
    """The request's column of the packed parameter tensor, in _PACKED_FIELDS order."""
    values = {name: float(getattr(params, name)) for name in _PACKED_FIELDS}
    values["temperature"] = 0.0 if params.greedy else float(params.temperature)
    values["top_k"] = float(min(params.top_k, 2**24))
    return tuple(values[name] for name in _PACKED_FIELDS)


def build_sampling_metadata(requests: list[Request], device: torch.device | str) -> SamplingMetadata:
    if not requests:
        raise ValueError("build_sampling_metadata needs at least one request")
    device = torch.device(device)
    params = [r.sampling_params for r in requests]
    # Requests of one generate() call share a SamplingParams object: per-parameter work runs once per
    # distinct object, and the per-request loops below run only when some request needs them.
    param_ids = list(map(id, params))
    kind_of_row = {pid: k for k, pid in enumerate(dict.fromkeys(param_ids))}   # id(params) -> distinct index
    by_id = dict(zip(param_ids, params))
    kinds = [by_id[pid] for pid in kind_of_row]
    random_params = [p for p in kinds if not p.greedy]

    # One column per distinct object, spread to the rows with one gather (or a broadcast when all share one).
    kind_columns = torch.tensor([_packed_row(p) for p in kinds], dtype=torch.float32).t()   # [fields, K]
    if len(kinds) == 1:
        packed = kind_columns.expand(len(_PACKED_FIELDS), len(params)).contiguous()        # [fields, R]
    else:
        packed = kind_columns[:, torch.tensor([kind_of_row[pid] for pid in param_ids])]
    if device.type == "cuda":
        packed = packed.pin_memory()
    on_device = packed.to(device, non_blocking=True)

    needs_penalties = any(p.needs_penalties for p in kinds)
    # Rows whose penalties are all neutral get empty histories: the result is the same, the scatter cheaper.
    prompt_ids = [list(r.prompt_token_ids) if r.sampling_params.repetition_penalty != 1.0 else []
                  for r in requests] if needs_penalties else None
    output_ids = [list(r.output_token_ids) if r.sampling_params.needs_penalties else []
                  for r in requests] if needs_penalties else None

    banned = {}
    if any(p.min_tokens > 0 for p in kinds):
        banned = {row: ids for row, r in enumerate(requests) if (ids := _banned_token_ids(r))}
    seeds = {}
    if any(p.seed is not None and not p.greedy for p in kinds):
        seeds = {row: _step_seed(r) for row, r in enumerate(requests)
                 if r.generator is not None and not r.sampling_params.greedy}
    logit_bias, allowed, grammar_rows, grammar_bitmask = {}, {}, [], None
    if any(p.edits_logits for p in kinds):
        logit_bias = {row: p.logit_bias for row, p in enumerate(params) if p.logit_bias}
        allowed = {row: p.allowed_token_ids for row, p in enumerate(params) if p.allowed_token_ids is not None}
        grammar_rows = [row for row, p in enumerate(params) if p.structured_outputs is not None]
        unbound = [requests[row].request_id for row in grammar_rows if requests[row].grammar is None]
        if unbound:
            raise ValueError(f"requests {unbound} ask for structured outputs but carry no grammar matcher (the "
                             "engine that queues a request binds one)")
    if grammar_rows:
        grammar_bitmask = fill_bitmasks([requests[row].grammar for row in grammar_rows], pin=device.type == "cuda")
        grammar_bitmask = grammar_bitmask.to(device, non_blocking=True)
    full_vocab_kinds = {id(p) for p in kinds if p.logprobs is not None or p.needs_penalties or p.edits_logits}
    full_vocab_rows = set(banned)
    if full_vocab_kinds:
        full_vocab_rows.update(row for row, pid in enumerate(param_ids) if pid in full_vocab_kinds)
    requested_logprobs = [p.logprobs for p in kinds if p.logprobs is not None]

    return SamplingMetadata(
        temperature=on_device[0],
        top_p=on_device[1],
        top_k=on_device[2].to(torch.int64),
        min_p=on_device[3],
        presence_penalty=on_device[4],
        frequency_penalty=on_device[5],
        repetition_penalty=on_device[6],
        all_greedy=not random_params,
        all_random=all(not p.greedy for p in kinds),
        # Filters only matter for rows that sample at random; greedy rows take the argmax regardless.
        no_top_p=all(p.top_p >= 1.0 for p in random_params),
        no_top_k=all(p.top_k == 0 for p in random_params),
        no_min_p=all(p.min_p == 0 for p in random_params),
        no_penalties=not needs_penalties,
        seeds=seeds,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        banned_token_ids=banned,
        logit_bias=logit_bias,
        allowed_token_ids=allowed,
        grammar_rows=grammar_rows,
        grammar_bitmask=grammar_bitmask,
        max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
        full_vocab_rows=sorted(full_vocab_rows),
    )
