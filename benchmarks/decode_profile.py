"""Where a decode step's GPU time goes: the kernels of eager engine steps at one batch size, by name.

    python3 benchmarks/decode_profile.py --model Qwen3-0.6B --batch 1

Runs `--batch` requests to their decode phase with CUDA graphs off (so every kernel is visible to the
profiler), profiles `--steps` engine steps and prints, per kernel name, the launches per step and the
GPU microseconds per step, next to the sum over all kernels. The sum is what a CUDA-graph replay of the
same step costs at best (a replay removes launch gaps, not kernel time), so it says how far kernel
count and kernel speed bound the step. The reference in the same run is the weight-bytes floor.
"""
from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pellucid.bench.args import add_model_args
from pellucid.bench.common import make_engine, print_table, random_prompts, weight_bytes_per_step
from pellucid.bench.floors import measure_floors
from pellucid.sampling_params import SamplingParams


def profile_decode_steps(args: argparse.Namespace, max_model_len: int, prompt_len: int, warm_steps: int
                         ) -> tuple[Any, profile]:
    """An engine for args.model with args.batch requests of `prompt_len` random tokens, stepped through the
    prefill and `warm_steps` - 1 decode steps, then args.steps decode steps under torch.profiler (CUDA)."""
    llm, _ = make_engine(args, max_model_len, max(args.batch, 1), 8192)
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + warm_steps + 20, ignore_eos=True,
                            detokenize=False)
    for i, prompt in enumerate(random_prompts([prompt_len] * args.batch, core.runner.head.vocab_size, args.seed)):
        llm.add_request(f"p{i}", prompt, params)
    for _ in range(warm_steps):
        llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
    return core, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25, help="kernel names to list")
    args = parser.parse_args()
    args.enforce_eager = True
    core, prof = profile_decode_steps(args, max_model_len=1024, prompt_len=128, warm_steps=5)
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name[event.name]
            entry[0] += 1
            entry[1] += event.device_time
    total_us = sum(v[1] for v in per_name.values()) / args.steps
    launches = sum(v[0] for v in per_name.values()) / args.steps
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:args.top]
    floor_us = measure_floors().bytes_time(weight_bytes_per_step(core.runner.model)) * 1e6
    print(f"{args.model}, batch {args.batch}, eager decode steps: {launches:.0f} kernels/step, "
          f"{total_us:.1f} us GPU time/step; weight-bytes floor {floor_us:.1f} us")
    print_table(["kernel", "launches/step", "us/step", "share"],
                [[name[:90], f"{n / args.steps:.0f}", f"{us / args.steps:.1f}", f"{us / args.steps / total_us:.1%}"]
                 for name, (n, us) in rows])


if __name__ == "__main__":
    main()
