"""Embedding throughput: `LLM.embed` against transformers' backbone on the same inputs, in the same run.

    python benchmarks/embed_bench.py [--model Qwen3-0.6B] [--num-inputs 2000] [--min-len 16] [--max-len 512]
                                     [--hf-batch 64] [--repeats 3] [--engine-process]

Rows (median of --repeats, interleaved):
- Pellucid `embed`: last-token pooling, normalised (the default pooler of a causal LM), and mean pooling;
- Pellucid prefill alone: `generate` with max_tokens=1 and no trace on the same inputs, so the row above
  minus this one is what the pooling's save and its copy to the host cost over the same forward passes;
- transformers: `AutoModel` in bf16 (sdpa attention), inputs sorted by length and padded in batches of
  --hf-batch (the least padding a batching client can get), the last real token pooled and normalised (its
  mean over the real tokens, for the mean row's check, comes from the same forward).
With --engine-process the engine core runs in its own process (as under `pellucid serve`), whose start-up
heap is frozen out of Python's cyclic garbage collector; in this process every full collection walks the
whole heap (model, torch, transformers). Prefix caching is off (the repeats embed the same inputs). Inputs/s, input tokens/s and the ratio to
transformers. Checks every Pellucid embedding against
transformers' (cosine similarity, bf16 on both sides, both poolings) and prints the smallest.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pellucid import PoolingParams, SamplingParams
from pellucid.bench.args import add_model_args
from pellucid.bench.common import make_engine, print_table, random_prompts
from pellucid.pooling.embedder import EMBED_SAMPLING, Embedder


def transformers_embed(model: torch.nn.Module, inputs: list[list[int]], batch: int
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(last-token, mean) embeddings, normalised."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[torch.Tensor | None] = [None] * len(inputs)
    out_mean: list[torch.Tensor | None] = [None] * len(inputs)
    with torch.no_grad():
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            width = max(len(inputs[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            hidden = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).last_hidden_state
            last = hidden[torch.arange(len(chunk), device="cuda"), mask.sum(dim=1).cuda() - 1]
            pooled = torch.nn.functional.normalize(last.float(), dim=1).cpu()
            weights = mask.cuda().unsqueeze(-1).float()
            mean = (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1)
            mean = torch.nn.functional.normalize(mean, dim=1).cpu()
            for row, i in enumerate(chunk):
                out[i], out_mean[i] = pooled[row], mean[row]
    return out, out_mean  # type: ignore[return-value]


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-inputs", type=int, default=2000)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-process", action="store_true", help="the engine core in its own process")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("embed_bench.py times GPU runs; it needs CUDA")
    args.gpu_memory_utilization = min(args.gpu_memory_utilization, 0.6)     # transformers shares the GPU
    # Prefix caching off: every repeat embeds the same inputs, and cached prompts would skip their compute.
    llm, model_dir = make_engine(args, max_model_len=args.max_len + 8, max_num_seqs=256,
                                 max_num_batched_tokens=16384, engine_process=args.engine_process,
                                 enable_prefix_caching=False)
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_inputs,),
                            generator=torch.Generator().manual_seed(args.seed)).tolist()
    inputs = random_prompts(lengths, llm.info.vocab_size, args.seed)
    num_tokens = sum(lengths)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    mean = Embedder.for_engine(llm.info, {"pooling_type": "mean"})

    def embed_mean() -> torch.Tensor:     # LLM.embed's path with the mean pooler
        outs = llm.generate(inputs, EMBED_SAMPLING, use_tqdm=False, extras=[mean.extras()] * len(inputs))
        return mean.embeddings(outs, PoolingParams())

    reference_name = f"transformers AutoModel (batches of {args.hf_batch}, sorted by length)"
    runs = {
        "Pellucid embed": lambda: llm.embed(inputs, use_tqdm=False),
        "Pellucid embed, mean pooling": embed_mean,
        "Pellucid prefill alone (generate, max_tokens=1)": lambda: llm.generate(inputs, prefill,
                                                                                         use_tqdm=False),
        reference_name: lambda: transformers_embed(hf, inputs, args.hf_batch),
    }
    for fn in runs.values():        # warm-up: kernels, graphs, allocator
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, object] = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            elapsed, results[name] = timed(fn)
            seconds[name].append(elapsed)

    ours = [out.outputs.data for out in results["Pellucid embed"]]
    theirs, theirs_mean = results[reference_name]
    cosine = min(torch.dot(a, b).item() for a, b in zip(ours, theirs))
    cosine = min(cosine, min(torch.dot(a, b).item() for a, b in zip(results["Pellucid embed, mean pooling"],
                                                                    theirs_mean)))
    reference = statistics.median(seconds[reference_name])
    rows = []
    for name, times in seconds.items():
        t = statistics.median(times)
        rows.append([name, f"{args.num_inputs / t:,.0f}", f"{num_tokens / t:,.0f}", f"{reference / t:.2f}"])
    print(f"{args.model}: {args.num_inputs} inputs of {args.min_len}-{args.max_len} tokens ({num_tokens:,} tokens), "
          f"bf16, {torch.cuda.get_device_name()}, engine core {'in its own process' if args.engine_process else 'in this thread'}; "
          f"median of {args.repeats}")
    print_table(["system", "inputs/s", "tokens/s", "vs transformers"], rows)
    print(f"smallest cosine similarity, Pellucid vs transformers embeddings: {cosine:.5f}")
    if cosine < 0.99:
        raise SystemExit("Pellucid's embeddings differ from transformers'")


if __name__ == "__main__":
    main()
