"""Cost of structured outputs: one batch unconstrained, held to a regex, and held to a JSON schema, in the
same run.

    python benchmarks/structured_bench.py [--model DIR] [--device auto] [--dtype auto] [--num-prompts 64]
                                          [--output-len 64] [--repeats 3] [--profile]

A constrained request's next-token mask is computed on the host (llguidance, all of a step's rows in
parallel threads) and copied to the device with the step's other sampling inputs; such requests never step
ahead, and the "serial steps" row (unconstrained, with min_tokens, which also keeps requests from stepping
ahead) shows what that alone costs. Prints output tokens/s (median of --repeats; the workloads interleave within each repeat) and the
ratio to the unconstrained batch (the median of each repeat's ratio), and checks the constrained outputs
against their constraint (every regex output, which runs to max_tokens; the JSON outputs that finished). Without --model it uses the embedded default model (pellucid-debian-13m), a
byte-level BPE tokenizer that can write JSON; its steps are short, so the mask's host time weighs the most.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import statistics
import time

import torch

from pellucid import LLM, SamplingParams, StructuredOutputsParams

REGEX = r"[a-z]+( [a-z]+)*(, [a-z]+( [a-z]+)*)*"      # never complete: the regex rows run to max_tokens
SCHEMA = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["word", "n"],
                                     "properties": {"word": {"type": "string", "maxLength": 12},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 999}}}}


def prompts(llm: LLM, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    vocab = llm.info.vocab_size
    return [torch.randint(10, min(vocab, 2000), (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def workloads(output_len: int) -> dict[str, SamplingParams]:
    common = dict(temperature=0.8, seed=1, max_tokens=output_len)
    return {
        "unconstrained": SamplingParams(ignore_eos=True, **common),
        # What the constrained rows pay for stepping serially (they never step ahead), without any mask:
        # min_tokens also keeps a request from stepping ahead.
        "unconstrained, serial steps": SamplingParams(ignore_eos=True, min_tokens=output_len, **common),
        # min_tokens keeps EOS off until max_tokens, so these rows are as long as the unconstrained ones
        "regex": SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX), min_tokens=output_len,
                                **common),
        "json schema": SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                                 disable_any_whitespace=True), **common),
    }


def check(name: str, text: str) -> bool:
    if name == "regex":     # cut at max_tokens: a prefix of a match (at most a letter or ", " short of one)
        return any(re.fullmatch(REGEX, text + tail) for tail in ("", "a", " a"))
    if name == "json schema":
        value = json.loads(text)
        return isinstance(value, list) and all(set(item) == {"word", "n"} for item in value)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="also run the regex batch once under cProfile: host time in llguidance's mask fill")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    batch = prompts(llm, args.num_prompts)
    runs = workloads(args.output_len)
    for params in runs.values():     # warm-up: kernels, a graph per batch size, the grammar tokenizer
        llm.generate(batch, params, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    matched: dict[str, tuple[int, int]] = {}
    lengths: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop" or name == "regex"]
            matched[name] = (sum(check(name, c.text) for c in finished), len(finished))
            lengths[name] = statistics.mean(len(o.outputs[0].token_ids) for o in outs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"device: {device}; {args.num_prompts} prompts x {args.output_len} tokens, temperature 0.8, "
          f"{args.repeats} repeats")
    print("| workload | mean output tokens | output tokens/s | ratio to unconstrained (each repeat) | outputs matching |")
    print("| --- | --- | --- | --- | --- |")
    base = rates["unconstrained"]
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, base)]
        ok, total = matched[name]
        print(f"| {name} | {lengths[name]:.1f} | {statistics.median(values):,.0f} | {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)}) | {ok} / {total} |")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(batch, runs["regex"], use_tqdm=False)
        profile.disable()
        fills = [(calls, seconds) for (_, _, function), (_, calls, seconds, _, _) in pstats.Stats(profile).stats.items()
                 if "compute_mask" in function]
        steps, seconds = sum(c for c, _ in fills), sum(s for _, s in fills)
        print(f"regex batch under cProfile: {steps} mask fills, {seconds / max(steps, 1) * 1e3:.2f} ms each, "
              f"{seconds / max(steps * len(batch), 1) * 1e6:.1f} us per row")


if __name__ == "__main__":
    main()
