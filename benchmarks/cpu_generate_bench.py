"""Same offline workload through Pellucid and through transformers' batched `generate`, on the CPU.

    python benchmarks/cpu_generate_bench.py [--num-prompts 32] [--output-len 64] [--repeats 3]

Prints output tokens/s for both (median of --repeats runs) and the ratio. The model is the embedded
default model (pellucid-debian-13m, Qwen3, float32 on the CPU); the figure measures engine work, not quality.
Figures in BENCHMARKS.md from before 2026-11-25 used the earlier random-weight default (4 layers, hidden 256).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from pellucid import LLM, SamplingParams
from pellucid.default_model import ensure_default_model


def workload(num_prompts: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 129, (num_prompts,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_pellucid(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def run_transformers(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):   # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return len(prompts) * output_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = ensure_default_model()
    llm = LLM(model_dir, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = workload(args.num_prompts, 0, llm.engine.runner.head.vocab_size)
    run_pellucid(llm, prompts[:2], 4)   # warm-up
    ours = statistics.median(run_pellucid(llm, prompts, args.output_len) for _ in range(args.repeats))
    ref = statistics.median(run_transformers(hf, prompts, args.output_len, 0) for _ in range(args.repeats))
    print(f"\nworkload: {args.num_prompts} prompts of 32-128 tokens, {args.output_len} output tokens each, "
          f"greedy, CPU, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'system':<28}{'output tok/s':>14}{'ratio':>10}")
    print(f"{'transformers generate':<28}{ref:>14.1f}{1.0:>10.2f}")
    print(f"{'pellucid':<28}{ours:>14.1f}{ours / ref:>10.2f}")


if __name__ == "__main__":
    main()
