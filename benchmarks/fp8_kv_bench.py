"""An FP8 KV cache against the model-dtype cache, in one run: decode steps at long contexts (where the KV read
outweighs the weights) and how many tokens each pool holds.

    python3 benchmarks/fp8_kv_bench.py --model Llama-3.1-8B --batch-sizes 1,32,64 --context 4096

Per batch size, the median engine decode step (CUDA graphs, stepping ahead; `pellucid bench latency`'s timing)
with the cache in the model's dtype ("auto") and in fp8 (e4m3), and each one's floor: the weights plus the KV at
the mean context, in the cache's bytes, over the copy bandwidth measured in the same run. Needs CUDA.
`--sweep` adds rows with other decode-attention tiles for the FP8 cache, and the model-dtype cache with the
K/V stores that an FP8 cache cannot fuse (rotary + KV store) run apart, as an FP8 cache runs them. `--kernels`
first times the attention kernels alone at Llama-3.1-8B's attention shape (benchmarks/attention_bench.py's method:
decode in CUDA graphs over enough layers' caches to overflow L2, prefill through the unified kernel), bf16 cache
against FP8.
"""
from __future__ import annotations

import argparse
import gc
import statistics

from pellucid.bench.args import add_model_args
from pellucid.bench.common import kv_bytes_per_token, make_engine, print_table, weight_bytes_per_step
from pellucid.bench.floors import measure_floors, print_floors
from pellucid.bench.latency import _run_batch
from pellucid.kernels import KERNELS

# name -> (kv cache dtype, TritonAttentionBackend knobs, PELLUCID_FUSED_KERNELS or None for the default)
VARIANTS = {
    "auto": ("auto", {}, None),
    "fp8": ("fp8", {}, None),
}
SWEEP = {
    "auto, small-batch tiles by SM count alone": ("auto", {"decode_small_batch_max_reqs": 1 << 20}, None),
    "fp8, small-batch tiles by SM count alone": ("fp8", {"decode_small_batch_max_reqs_fp8": 1 << 20}, None),
    "auto, K/V stores apart": ("auto", {}, ",".join(k for k in KERNELS if k != "rotary_kv_store")),
    "fp8, tiles x2 tokens": ("fp8", {"decode_block_n_small_batch": 256, "decode_block_n_large_batch": 128}, None),
    "fp8, 8 warps at large batches": ("fp8", {"decode_num_warps": 8}, None),
    "fp8, 3 stages": ("fp8", {"decode_num_stages": 3}, None),
    "fp8, tiles x2, 8 warps": ("fp8", {"decode_block_n_small_batch": 256, "decode_block_n_large_batch": 128,
                                       "decode_num_warps": 8}, None),
}


def _decode_kernel(batch: int, context: int, kv_dtype):
    """(microseconds per layer of decode attention, its output) at `batch` requests of `context` tokens."""
    import math

    import torch
    from attention_bench import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, graph_ms_per_call, paged_metadata
    from pellucid.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"),
                                     kv_cache_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(batch * 7 + context)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    layers = max(1, min(32, math.ceil(4 * torch.cuda.get_device_properties(0).L2_cache_size / kv_bytes)))
    blocks = batch * math.ceil(context / BLOCK_SIZE) + 8
    metadata = backend.build_metadata(paged_metadata([1] * batch, [context] * batch, blocks, gen))
    torch.manual_seed(0)
    caches = [torch.randn(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
              for _ in range(layers)]
    query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = backend.forward(query, caches[0], metadata, HEAD_DIM ** -0.5)
    ms = graph_ms_per_call([lambda c=c: backend.forward(query, c, metadata, HEAD_DIM ** -0.5) for c in caches])
    return ms * 1e3, out


def _prefill_kernel(q_len: int, prefix: int, kv_dtype) -> float:
    """Microseconds of the unified kernel for one request's q_len new tokens after a cached prefix."""
    import math

    import torch
    from attention_bench import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, median_ms, paged_metadata
    from pellucid.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"),
                                     kv_cache_dtype=kv_dtype)
    blocks = math.ceil((q_len + prefix) / BLOCK_SIZE) + 8
    gen = torch.Generator().manual_seed(q_len)
    metadata = backend.build_metadata(paged_metadata([q_len], [q_len + prefix], blocks, gen))
    cache = torch.randn(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    query = torch.randn(q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return median_ms(lambda: backend.forward(query, cache, metadata, HEAD_DIM ** -0.5), rep=100) * 1e3


def kernel_tables() -> None:
    import torch

    rows = []
    for batch, context in ((1, 200), (1, 8192), (4, 4096), (16, 4096), (64, 4096), (128, 4096), (256, 2048)):
        auto_us, auto_out = _decode_kernel(batch, context, torch.bfloat16)
        fp8_us, fp8_out = _decode_kernel(batch, context, torch.float8_e4m3fn)
        diff = (auto_out.float() - fp8_out.float()).abs().max().item()
        rows.append([str(batch), str(context), f"{auto_us:.1f}", f"{fp8_us:.1f}", f"{fp8_us / auto_us:.2f}",
                     f"{diff:.3f}"])
    print("decode attention alone, Llama-3.1-8B's shape (32 query / 8 KV heads of 128), us per layer")
    print_table(["batch", "context", "bf16 cache", "fp8 cache", "fp8 / bf16", "max |fp8 - bf16| output"], rows)
    rows = []
    for q_len, prefix in ((8192, 0), (512, 4096), (2048, 2048)):
        auto_us, fp8_us = (_prefill_kernel(q_len, prefix, dt) for dt in (torch.bfloat16, torch.float8_e4m3fn))
        rows.append([f"{q_len} + {prefix}", f"{auto_us:.0f}", f"{fp8_us:.0f}", f"{fp8_us / auto_us:.2f}"])
    print("\nprefill through the unified kernel, us")
    print_table(["new tokens + cached prefix", "bf16 cache", "fp8 cache", "fp8 / bf16"], rows)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", default="1,32,64")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also other FP8 decode tiles (see the docstring)")
    parser.add_argument("--kernels", action="store_true", help="first time the attention kernels alone")
    parser.add_argument("--variants", default=None,
                        help="semicolon-separated variant names to run (default: auto and fp8, plus --sweep's)")
    args = parser.parse_args()
    if args.kernels:
        kernel_tables()
    import os

    import torch
    from pellucid.attention.triton_backend import TritonAttentionBackend

    floors = measure_floors()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.context + args.output_len + 16
    rows, pools = [], []
    results: dict[tuple[str, int], float] = {}
    variants = dict(VARIANTS, **(SWEEP if args.sweep else {}))
    if args.variants:
        known = dict(VARIANTS, **SWEEP)
        unknown = [name for name in args.variants.split(";") if name not in known]
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {list(known)}")
        variants = {name: known[name] for name in args.variants.split(";")}
    for name, (kv, knobs, fused) in variants.items():
        args.kv_cache_dtype = kv
        saved = {knob: getattr(TritonAttentionBackend, knob) for knob in knobs}
        for knob, value in knobs.items():
            setattr(TritonAttentionBackend, knob, value)
        if fused is not None:
            os.environ["PELLUCID_FUSED_KERNELS"] = fused
        llm, _ = make_engine(args, max_len, max(batches), 8192)
        core = llm.engine
        model = core.runner.model
        weights = weight_bytes_per_step(model)
        kv_token = kv_bytes_per_token(model, core.runner.kv_dtype)
        if name in VARIANTS:
            pools.append([kv, str(core.runner.kv_dtype).removeprefix("torch."), f"{core.num_blocks:,}",
                          f"{core.num_blocks * core.config.cache.block_size:,}"])
        _run_batch(llm, 1, 16, 8, args.seed + 99)      # warm-up: compilation
        for batch in batches:
            _, steps = _run_batch(llm, batch, args.context, args.output_len, args.seed + batch)
            step = statistics.median(steps)
            results[(name, batch)] = step
            floor = floors.bytes_time(weights + batch * (args.context + args.output_len / 2) * kv_token)
            rows.append([name, str(batch), f"{batch * (args.context + args.output_len / 2) * kv_token / 1e9:.2f}",
                         f"{step * 1e3:.3f}", f"{floor * 1e3:.3f}", f"{step / floor:.2f}x",
                         "-" if name == "auto" else f"{step / results[('auto', batch)]:.2f}"])
        del llm, core, model
        gc.collect()
        torch.cuda.empty_cache()
        for knob, value in saved.items():
            setattr(TritonAttentionBackend, knob, value)
        os.environ.pop("PELLUCID_FUSED_KERNELS", None)
    print_floors(floors)
    print(f"\n{args.model}, prompts of {args.context} tokens, {args.output_len} generated")
    print_table(["variant", "batch", "KV GB read/step", "decode ms/step", "floor ms/step", "step / floor",
                 "step vs auto"], rows)
    print()
    print_table(["kv cache", "dtype", "blocks", "tokens held"], pools)


if __name__ == "__main__":
    main()
