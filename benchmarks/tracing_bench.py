"""Cost of tracing: one batch untraced, with every request saving one layer's output, and with every
request adding a steering vector at one layer, measured in the same run.

    python benchmarks/tracing_bench.py [--model DIR] [--device auto] [--num-prompts 32] [--output-len 64]
                                       [--repeats 3] [--layer N]

The prefix cache is off unless --enable-prefix-caching: the repeats resend the same prompts, and only
untraced requests read the cache (a traced request computes every prompt position itself).
Prints output tokens/s (median of --repeats; the three workloads are interleaved within each repeat)
and the ratio to untraced. Without --model it uses the embedded default model (random weights).
On a GPU, decode steps whose ops are all taps (save, add, ... ; pellucid/tracing/taps.py) replay CUDA
graphs captured with those taps, like untraced steps; the last line says how many replays had taps.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from pellucid import LLM, SamplingParams
from pellucid.tracing import Add, Save, TracePlan


def workload(num_prompts: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 129, (num_prompts,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams,
          extras: Callable[[], list[dict[str, Any] | None]]) -> float:
    batch_extras = extras()
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, extras=batch_extras)
    elapsed = time.perf_counter() - start
    assert all(o.error is None and len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return len(prompts) * params.max_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HuggingFace-format directory (default: the embedded model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer", type=int, default=None, help="layer to trace (default: the middle one)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs for any step (separates the cost of eager steps from that of tracing)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="keep the prefix cache on; off by default because every repeat sends the same prompts, so "
                         "untraced requests would skip their prefill from the cache while traced ones never read it")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              enable_prefix_caching=args.enable_prefix_caching)
    hf_config = llm.engine.hf_config
    layer = args.layer if args.layer is not None else hf_config.num_hidden_layers // 2
    site = f"model.layers.{layer}"
    prompts = workload(args.num_prompts, 0, llm.engine.runner.head.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vector = torch.randn(hf_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.1
    workloads: dict[str, Callable[[], list[dict[str, Any] | None]]] = {
        "untraced": lambda: [None] * len(prompts),
        f"save {site}.output": lambda: [{"trace": TracePlan([Save(site=site)])} for _ in prompts],
        f"add vector at {site}.output": lambda: [{"trace": TracePlan([Add(site=site, value=vector)])} for _ in prompts],
    }
    for make in workloads.values():   # warm-up (and the site probe)
        timed(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), make)
    results: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.repeats):
        for name, make in workloads.items():
            results[name].append(timed(llm, prompts, params, make))
    medians = {name: statistics.median(values) for name, values in results.items()}
    base = medians["untraced"]
    device = torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"\nworkload: {args.num_prompts} prompts of 32-128 tokens, {args.output_len} output tokens each, greedy; "
          f"model {llm.engine.model_name} ({llm.engine.dtype}); {device}; median of {args.repeats}"
          f"{'; enforce_eager' if args.enforce_eager else ''}"
          f"; prefix caching {'on' if args.enable_prefix_caching else 'off'}")
    print(f"{'workload':<40}{'output tok/s':>14}{'vs untraced':>13}")
    for name, value in medians.items():
        print(f"{name:<40}{value:>14.1f}{value / base:>13.2f}")
    graphs = llm.engine.runner.cuda_graphs
    if graphs is not None:
        print(f"CUDA graph replays: {graphs.num_replays}, of which with tracing taps: {graphs.num_tap_replays}")


if __name__ == "__main__":
    main()
