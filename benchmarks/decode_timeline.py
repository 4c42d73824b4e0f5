"""What each kernel of a CUDA-graph decode step adds to the step's critical path.

    python3 benchmarks/decode_timeline.py --model Qwen3-0.6B --batch 1 [--steps 20]

`decode_profile.py` sums eager kernels; with CUDA graphs and programmatic dependent launch the kernels
of a step overlap (a kernel starts while its predecessor still runs, and waits inside), so a kernel's
duration says little about what it costs the step. This script profiles steady decode steps as the
engine runs them (graph replays, then the head and sampler) and orders every kernel by its end: each
kernel ends after the one before it on the stream, so `end[i] - end[i-1]` is what kernel i adds to the
step. Per kernel name it prints launches per step, the mean duration and the mean advance; their sum
is the step's GPU time, next to the measured step time and the weight-bytes floor of the same run.
"started ahead" is how long before the previous kernel's end a kernel started, on average (under
programmatic dependent launch, the time it had to load weights ahead of its wait; negative: a gap).
"""
from __future__ import annotations

import argparse
import collections

import torch
from decode_profile import profile_decode_steps     # benchmarks/ is on sys.path when run as a script

from pellucid.bench.args import add_model_args
from pellucid.bench.common import print_table, weight_bytes_per_step
from pellucid.bench.floors import measure_floors
from pellucid.bench.moe import decode_bytes, sparse_blocks


def short_name(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def _step_weight_bytes(model, batch: int) -> tuple[float, str]:
    """(weight bytes a decode step of `batch` tokens reads, a note on how they were counted). A
    mixture-of-experts step reads only the experts its tokens chose: min(experts, batch * top_k) per layer,
    exact at batch 1 and an upper bound above it (`pellucid bench latency` measures the count)."""
    dense = weight_bytes_per_step(model)
    blocks = sparse_blocks(model)
    if not blocks:
        return dense, ""
    spec = blocks[0][1].spec
    touched = min(spec.num_experts, batch * spec.top_k)
    exact = "" if batch == 1 else ", an upper bound"
    return decode_bytes(model, dense, touched), f" (counting {touched} experts per MoE layer{exact})"


def _position_labels(kernels: list, steps: int, layers: int) -> list[str]:
    """Each kernel's name, with its place in the layer for names launched several times per layer."""
    per_step = collections.Counter(name for _, _, name in kernels)
    seen: collections.Counter = collections.Counter()
    labels = []
    for _, _, name in kernels:
        count = per_step[name] // steps
        per_layer = count // layers
        i = seen[name] % max(count, 1)
        seen[name] += 1
        if per_layer < 2:
            labels.append(name)
        else:
            labels.append(f"{name[:50]}[{i % per_layer if i < per_layer * layers else 'end'}]")
    return labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=30, help="kernel names to list")
    parser.add_argument("--by-position", action="store_true",
                        help="split a kernel launched several times per layer by its place in the layer "
                             "(name[i]: its i-th launch in each layer; name[end]: launches after the layers)")
    args = parser.parse_args()
    core, prof = profile_decode_steps(args, max_model_len=2048, prompt_len=args.prompt_len, warm_steps=10)
    kernels = sorted((e.time_range.end, e.time_range.start, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if len(kernels) < 2:
        raise SystemExit("the profiler recorded no CUDA kernels")
    steps = args.steps
    label = _position_labels(kernels, steps, len(core.runner.model.model.layers)) if args.by_position else None
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    previous_end = kernels[0][0]
    for i, (end, start, name) in enumerate(kernels[1:], start=1):
        entry = stats[label[i] if label else name]
        entry[0] += 1
        entry[1] += end - start
        entry[2] += end - previous_end
        entry[3] += previous_end - start
        previous_end = end
    span_us = (kernels[-1][0] - kernels[0][0]) / steps
    step_bytes, floor_note = _step_weight_bytes(core.runner.model, args.batch)
    floor_us = measure_floors().bytes_time(step_bytes) * 1e6
    print(f"{args.model}, batch {args.batch}, graph decode steps: {len(kernels) / steps:.0f} kernels/step, "
          f"{span_us:.1f} us/step of GPU timeline; weight-bytes floor {floor_us:.1f} us{floor_note}")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    print_table(["kernel", "launches/step", "mean us", "started ahead us", "advance us/step", "share"],
                [[short_name(name), f"{n / steps:.0f}", f"{dur / n:.2f}", f"{ahead / n:.2f}", f"{adv / steps:.1f}",
                  f"{adv / steps / span_us:.1%}"] for name, (n, dur, adv, ahead) in rows])


if __name__ == "__main__":
    main()
