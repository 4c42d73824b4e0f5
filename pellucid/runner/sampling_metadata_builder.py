"""Builds one step's SamplingMetadata from the Requests that sample, in batch order.

Per-row parameters are packed into one host tensor (pinned when the device is CUDA) and sent with a
single non-blocking copy; the stage flags are computed on the host so the sampler can skip stages.
"""
from __future__ import annotations

import torch

from pellucid.engine.request import Request
from pellucid.runner.sampling_metadata import SamplingMetadata

# Rows of the packed parameter tensor. top_k travels as float32, capped at 2**24 where float32 is still
# exact: a larger k exceeds every vocabulary, so it means "no cut" either way.
_PACKED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")


def _row_generator(request: Request, device: torch.device) -> torch.Generator:
    """The generator a seeded row draws from this step.

    Requests keep a CPU generator. On CPU it is used as is; on another device each step seeds a fresh
    device generator from the request's CPU generator, so the draw still depends only on the request's
    seed and how many steps it has sampled, never on the batch around it.
    """
    assert request.generator is not None
    if device.type == "cpu":
        return request.generator
    step_seed = int(torch.randint(0, 2**62, (1,), generator=request.generator))
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed)
    return generator


def _banned_token_ids(request: Request) -> list[int]:
    """EOS and stop token ids stay masked until the request has produced min_tokens tokens."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    return sorted(request.eos_token_ids | set(params.stop_token_ids))


def build_sampling_metadata(requests: list[Request], device: torch.device | str) -> SamplingMetadata:
    if not requests:
        raise ValueError("build_sampling_metadata needs at least one request")
    device = torch.device(device)
    params = [r.sampling_params for r in requests]
    greedy = [p.greedy for p in params]
    random_params = [p for p, g in zip(params, greedy) if not g]

    values = {name: [float(getattr(p, name)) for p in params] for name in _PACKED_FIELDS}
    values["temperature"] = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
    values["top_k"] = [float(min(p.top_k, 2**24)) for p in params]
    packed = torch.tensor([values[name] for name in _PACKED_FIELDS], dtype=torch.float32)
    if device.type == "cuda":
        packed = packed.pin_memory()
    on_device = packed.to(device, non_blocking=True)

    needs_penalties = any(p.needs_penalties for p in params)
    # Rows whose penalties are all neutral get empty histories: the result is the same, the scatter cheaper.
    prompt_ids = [list(r.prompt_token_ids) if r.sampling_params.repetition_penalty != 1.0 else []
                  for r in requests] if needs_penalties else None
    output_ids = [list(r.output_token_ids) if r.sampling_params.needs_penalties else []
                  for r in requests] if needs_penalties else None

    banned = {row: ids for row, r in enumerate(requests) if (ids := _banned_token_ids(r))}
    generators = {row: _row_generator(r, device) for row, (r, g) in enumerate(zip(requests, greedy))
                  if r.generator is not None and not g}
    requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]

    return SamplingMetadata(
        temperature=on_device[0],
        top_p=on_device[1],
        top_k=on_device[2].to(torch.int64),
        min_p=on_device[3],
        presence_penalty=on_device[4],
        frequency_penalty=on_device[5],
        repetition_penalty=on_device[6],
        all_greedy=all(greedy),
        all_random=not any(greedy),
        # Filters only matter for rows that sample at random; greedy rows take the argmax regardless.
        no_top_p=all(p.top_p >= 1.0 for p in random_params),
        no_top_k=all(p.top_k == 0 for p in random_params),
        no_min_p=all(p.min_p == 0 for p in random_params),
        no_penalties=not needs_penalties,
        generators=generators,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        banned_token_ids=banned,
        max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
    )
