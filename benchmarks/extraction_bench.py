"""Extraction throughput (hidden states of 3 layers written to safetensors files) against plain prefill
of the same prompts, measured in the same run.

    python benchmarks/extraction_bench.py                                   # CPU: a small random Llama
    python benchmarks/extraction_bench.py --model Llama-3.1-8B --min-len 1024 --max-len 2048 \\
        --num-prompts 96 --out-root /tmp                                      # GPU: the issue's target shape

Plain prefill = `llm.generate(prompts, max_tokens=1)` with prefix caching off (so repeats recompute).
Extraction = `llm.extract_hidden_states(...)` into a fresh directory, timed until every file is written,
fsynced and listed in the manifest. Both count prompt tokens per second; the table gives the median of
--repeats (workloads interleaved within each repeat) and the ratio extraction / prefill.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from pellucid import LLM, SamplingParams


def default_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers, as EAGLE-3 style speculators take them."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})  # 32 layers: 2, 16, 29


def resolve_model(name: str | None, cache: str) -> str:
    if name is None:
        from pellucid.tiny_models import build_tiny_model
        path = os.path.join(cache, "cpu-llama-h256-l8")
        if not os.path.exists(os.path.join(path, "config.json")):
            build_tiny_model("llama", path, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
        return path
    from pellucid.bench.models import resolve_model as resolve_named
    return resolve_named(name, cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a named random shape (e.g. Llama-3.1-8B) or a directory; "
                                                  "default: a small random Llama for the CPU")
    ap.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--layers", default=None, help="comma-separated layer ids (default: low, middle, high)")
    ap.add_argument("--shard-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out-root", default=tempfile.gettempdir(),
                    help="where the output directories go; comma-separated for one extraction row per place "
                         "(e.g. /tmp,/dev/shm separates the disk from the rest)")
    args = ap.parse_args()

    model_dir = resolve_model(args.model, args.model_cache)
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, enable_prefix_caching=False,
              max_model_len=args.max_len + 16, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    num_layers = engine.hf_config.num_hidden_layers
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(num_layers)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_prompts,), generator=gen).tolist()
    vocab = min(engine.runner.head.vocab_size, 500)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    num_tokens = sum(lengths)
    cuda = engine.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def prefill() -> float:
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        sync()
        assert all(o.error is None for o in outs)
        return num_tokens / (time.perf_counter() - start)

    def extract(root: str) -> float:
        out = tempfile.mkdtemp(prefix="extraction-bench-", dir=root)
        try:
            sync()
            start = time.perf_counter()
            summary = llm.extract_hidden_states(prompts, layers=layers, output_dir=out, shard_size=args.shard_size,
                                                progress=False)
            elapsed = time.perf_counter() - start
            assert summary.num_tokens == num_tokens
            return num_tokens / elapsed
        finally:
            shutil.rmtree(out, ignore_errors=True)

    # Warm-up, one full round of each (not counted): kernels, allocator pools at full step size, the
    # tracing site probe, the writer.
    roots = args.out_root.split(",")
    prefill()
    extract(roots[0])

    results: dict[str, list[float]] = {"prefill": [], **{root: [] for root in roots}}
    for _ in range(args.repeats):
        results["prefill"].append(prefill())
        for root in roots:
            results[root].append(extract(root))
    print("runs (tokens/s):", {name: [round(v) for v in values] for name, values in results.items()})
    base = statistics.median(results["prefill"])
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    hidden = engine.hf_config.hidden_size
    gb = num_tokens * len(layers) * hidden * torch.empty((), dtype=engine.dtype).element_size() / 1e9
    print(f"\nworkload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens ({num_tokens} tokens), "
          f"layers {layers}, {gb:.2f} GB of hidden states per run, shard size {args.shard_size}; model {args.model or model_dir} "
          f"({str(engine.dtype).removeprefix('torch.')}); {device}; median of {args.repeats}")
    print("| workload | system | tokens/s | vs plain prefill |")
    print("|---|---|---|---|")
    print(f"| prefill {args.min_len}-{args.max_len} tokens | plain prefill (max_tokens=1) | {base:,.0f} | 1.00 |")
    for root in roots:
        ext = statistics.median(results[root])
        print(f"| same prompts | extraction, {len(layers)} layers, files written to {root} | {ext:,.0f} | "
              f"{ext / base:.2f} |")


if __name__ == "__main__":
    main()
