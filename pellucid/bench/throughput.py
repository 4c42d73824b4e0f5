"""`pellucid bench throughput`: the nano-vllm offline workload (256 requests, input and output lengths
uniform in [100, 1024], seeded, random token ids, ignore_eos), against

- the workload's memory floor: every decode step reads the weights at least once and at least
  max(output length) steps are needed; every generated token reads its request's KV so far; over the
  copy bandwidth measured in the same run;
- transformers' batched `generate` on the same GPU, on a documented subset of the workload (the first
  --hf-requests requests with both lengths scaled by --hf-scale) that Pellucid also runs, so the ratio
  compares the same work. One `generate` call pads to the longest prompt and runs max(output) steps
  for everyone; only the tokens each request asked for count as useful. It runs first, before the engine
  is built, so each has the GPU to itself. A shape whose weights are drawn at load (bench/models.py)
  gets transformers' own random initialisation.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from pellucid.bench.common import (kv_bytes_per_token, make_engine, print_table, random_prompts,
                                   weight_bytes_per_step)
from pellucid.bench.floors import measure_floors, print_floors
from pellucid.bench.moe import decode_bytes, is_moe, measure_experts_touched


def workload(num: int, lo: int, hi: int, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    outputs = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return inputs, outputs


def run_engine(llm, prompts: list[list[int]], output_lens: list[int], tag: str) -> float:
    from pellucid.sampling_params import SamplingParams

    for i, (prompt, out) in enumerate(zip(prompts, output_lens)):
        llm.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True,
                                                             detokenize=False))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_transformers(model_dir: str, prompts: list[list[int]], output_lens: list[int]) -> float:
    import os

    from transformers import AutoModelForCausalLM

    from pellucid.models.loader import RANDOM_WEIGHTS_FILE, read_hf_config

    if os.path.isfile(os.path.join(model_dir, RANDOM_WEIGHTS_FILE)):
        # A shape with no weight files (bench/models.py): transformers draws its own random weights.
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(read_hf_config(model_dir), dtype=torch.bfloat16).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):     # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    steps = max(output_lens)
    with torch.inference_mode():
        model.generate(input_ids=ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)   # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return elapsed


def memory_floor_bytes(weights: int, kv_token: int, input_lens: list[int], output_lens: list[int]) -> float:
    decode_weights = max(output_lens) * weights
    kv_read = sum(kv_token * (n_in * n_out + n_out * (n_out - 1) / 2) for n_in, n_out in zip(input_lens, output_lens))
    return decode_weights + kv_read


def run_throughput(args: argparse.Namespace) -> None:
    from pellucid.bench.models import resolve_model
    from pellucid.models.loader import read_hf_config

    floors = measure_floors()
    input_lens, output_lens = workload(args.num_requests, args.min_len, args.max_len, args.seed)
    model_dir = resolve_model(args.model, args.model_cache)
    prompts = random_prompts(input_lens, read_hf_config(model_dir).vocab_size, args.seed)
    theirs = None
    if args.hf_requests:
        # transformers first, alone on the GPU: a large model's engine and its transformers copy need not
        # fit together (Qwen3-30B-A3B: 57 GiB each on an 80 GB card).
        n = min(args.hf_requests, args.num_requests)
        sub_in = [max(1, round(x * args.hf_scale)) for x in input_lens[:n]]
        sub_out = [max(1, round(x * args.hf_scale)) for x in output_lens[:n]]
        sub_prompts = [p[:k] for p, k in zip(prompts[:n], sub_in)]
        theirs = run_transformers(model_dir, sub_prompts, sub_out)
        gc.collect()
        torch.cuda.empty_cache()
    llm, _ = make_engine(args, args.max_len * 2 + 16, args.max_num_seqs, args.max_num_batched_tokens)
    core = llm.engine
    vocab = core.runner.head.vocab_size
    run_engine(llm, random_prompts([32] * 4, vocab, args.seed + 7), [8] * 4, "warmup")
    elapsed = run_engine(llm, prompts, output_lens, "tp")
    ours = run_engine(llm, sub_prompts, sub_out, "sub") if theirs is not None else None
    model = core.runner.model
    weights = weight_bytes_per_step(model)
    if is_moe(model):    # the experts a full batch touches per step (nearly all of them from ~64 tokens on)
        batch = min(args.max_num_seqs, args.num_requests)
        weights = decode_bytes(model, weights, measure_experts_touched(llm, batch, 64, 4, args.seed + 3))
    floor = floors.bytes_time(memory_floor_bytes(weights, kv_bytes_per_token(model, core.runner.kv_dtype), input_lens,
                                                 output_lens))
    tokens = sum(output_lens)
    print_floors(floors)
    print(f"\nworkload: {args.num_requests} requests, input and output lengths uniform in [{args.min_len}, "
          f"{args.max_len}] (seed {args.seed}), {sum(input_lens)} prompt + {tokens} output tokens, ignore_eos, "
          "no detokenization")
    rows = [[args.model, "pellucid", "full workload", f"{elapsed:.2f}", f"{tokens / elapsed:.0f}",
             f"floor {floor:.2f} s", f"{floor / elapsed:.2f} of floor"]]
    if theirs is not None and ours is not None:
        sub_tokens = sum(sub_out)
        label = f"first {n} requests, lengths x{args.hf_scale}"
        rows.append([args.model, "pellucid", label, f"{ours:.2f}", f"{sub_tokens / ours:.0f}", "", ""])
        rows.append([args.model, "transformers generate", label, f"{theirs:.2f}", f"{sub_tokens / theirs:.0f}", "",
                     f"pellucid {theirs / ours:.1f}x faster"])
    print_table(["model", "system", "work", "seconds", "output tok/s", "reference", "ratio"], rows)
