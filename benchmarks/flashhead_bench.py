"""FlashHead on a GPU: head-only latency (dense vs FlashHead) and end-to-end decode tokens/s.

Head mode (default), for Qwen3-0.6B and Llama-3.2-1B head shapes with random weights: build the clustering
on the device (timed), build the head (which measures its batch-size crossover, see crossover.py), then
per batch size time, as CUDA-graph replays, dense logits + argmax vs FlashHead greedy (the fast path
alone, and `head.sample` with its routing), and dense logits + sampler vs FlashHead sampling
(temperature 1). At the first and last batch: per-stage times and block-size sweeps of each kernel.

E2E mode (--e2e): a random-weight Qwen3-0.6B-shaped checkpoint (pellucid.bench.models), its FlashHead
asset, then batch-1 greedy decode through the engine (EngineCore, CUDA graphs) with each head.

    python benchmarks/flashhead_bench.py [--shapes qwen3-0.6b,llama-3.2-1b] [--batches 1,8,64] [--json OUT]
    python benchmarks/flashhead_bench.py --e2e [--e2e-model Qwen3-0.6B] [--output-len 256] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pellucid.heads.flashhead import kernels  # noqa: E402
from pellucid.heads.flashhead.asset import save_asset  # noqa: E402
from pellucid.heads.flashhead.cli import measure_latency_us  # noqa: E402
from pellucid.heads.flashhead.clustering import balanced_spherical_kmeans  # noqa: E402
from pellucid.heads.flashhead.crossover import time_us as gpu_time_us  # noqa: E402
from pellucid.heads.flashhead.head import FlashHead  # noqa: E402
from pellucid.runner.sampler import Sampler  # noqa: E402
from pellucid.runner.sampling_metadata import SamplingMetadata  # noqa: E402

SHAPES = {"qwen3-0.6b": (151936, 1024), "llama-3.2-1b": (128256, 2048)}


def sampling_metadata(rows: int, device: torch.device, temperature: float) -> SamplingMetadata:
    ones, zeros = torch.ones(rows, device=device), torch.zeros(rows, device=device)
    return SamplingMetadata(temperature=torch.full((rows,), temperature, device=device), top_p=ones.clone(),
                            top_k=torch.zeros(rows, dtype=torch.int64, device=device), min_p=zeros.clone(),
                            presence_penalty=zeros.clone(), frequency_penalty=zeros.clone(),
                            repetition_penalty=ones.clone(), all_greedy=temperature == 0,
                            all_random=temperature > 0, no_top_p=True, no_top_k=True, no_min_p=True,
                            no_penalties=True)


# ------------------------------------------------------------------------------------------ head mode

def bench_shape(name: str, batches: list[int], probes: int, cluster_size: int, iterations: int,
                device: torch.device, dtype: torch.dtype, graph: bool, sweep: bool) -> list[dict]:
    vocab, hidden_size = SHAPES[name] if name in SHAPES else map(int, name.split("x"))  # or "VxH"
    generator = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size ** -0.5).to(device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    clustering = balanced_spherical_kmeans(weight, cluster_size=cluster_size, iterations=iterations, device=device)
    build_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        head = FlashHead(weight, {"asset": save_asset(tmp, clustering, weight), "probes": probes})
    sampler = Sampler()
    results = []
    for batch in batches:
        hidden = torch.randn(batch, hidden_size, generator=generator).to(device, dtype)
        greedy_meta, random_meta = sampling_metadata(batch, device, 0.0), sampling_metadata(batch, device, 1.0)
        time_us = (lambda fn: measure_latency_us(fn, device, cuda_graph=graph))
        with torch.no_grad():
            dense_top1 = head.compute_logits(hidden).argmax(dim=1)
            fast = head.greedy(hidden)
            reference = kernels.argmax_tokens(*kernels.stage2_torch(
                hidden, head.cluster_weight, head.cluster_token_ids,
                kernels.stage1_torch(hidden, head.centroids, None, None).topk(probes, dim=1).indices))
            row = {"shape": name, "vocab": vocab, "hidden": hidden_size, "batch": batch, "probes": probes,
                   "clusters": head.num_clusters, "cluster_size": head.cluster_size, "build_s": build_s,
                   "max_fast_batch": head.max_fast_batch,
                   "agreement_random": float((fast == dense_top1).float().mean()),
                   "matches_torch_reference": float((fast == reference).float().mean()),
                   "dense_greedy_us": time_us(lambda: head.compute_logits(hidden).argmax(dim=1)),
                   "flash_greedy_us": time_us(lambda: head.greedy(hidden)),
                   "routed_greedy_us": time_us(lambda: head.sample(hidden, greedy_meta, sampler)),
                   "dense_sample_us": time_us(lambda: sampler(head.compute_logits(hidden), random_meta)),
                   "flash_sample_us": time_us(lambda: head._sample_fast(hidden, random_meta, sampler)),
                   "routed_sample_us": time_us(lambda: head.sample(hidden, random_meta, sampler))}
            if graph:   # GPU time per call: back-to-back replays, without each replay's launch latency
                row["dense_greedy_gpu_us"] = gpu_time_us(lambda: head.compute_logits(hidden).argmax(dim=1))
                row["flash_greedy_gpu_us"] = gpu_time_us(lambda: head.greedy(hidden))
            if batch in (batches[0], batches[-1]):
                row.update(stage_times(head, hidden, device, graph, sweep))
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def stage_times(head: FlashHead, hidden: torch.Tensor, device: torch.device, graph: bool, sweep: bool) -> dict:
    """Per-stage latency, and block sweeps (which shapes keep the SMs busy at this batch)."""
    keys = kernels.stage1(hidden, head.centroids, None, None)
    clusters = kernels.select_top(keys, head.probes)
    assert torch.equal(clusters.sort(dim=1).values, keys.topk(head.probes, dim=1).indices.sort(dim=1).values)
    args = (hidden, head.cluster_weight, head.cluster_token_ids, clusters)
    time_us = (lambda fn: measure_latency_us(fn, device, cuda_graph=graph))
    out = {"stage1_us": time_us(lambda: kernels.stage1(hidden, head.centroids, None, None)),
           "topk_us": time_us(lambda: keys.topk(head.probes, dim=1, sorted=False)),
           "stage2_logits_us": time_us(lambda: kernels.stage2(*args))}
    if not kernels.use_triton(hidden):
        return out
    rows = hidden.shape[0]
    state = kernels.greedy_state(rows, device)
    histogram = kernels.selection_histogram(rows, device)
    kernels.stage1_triton(hidden, head.centroids, None, None, histogram=histogram)
    out["zero_histogram_us"] = time_us(lambda: kernels.selection_histogram(rows, device))
    out["stage1_histogram_us"] = time_us(lambda: kernels.stage1_triton(
        hidden, head.centroids, None, None, histogram=kernels.selection_histogram(rows, device)))
    out["select_us"] = time_us(lambda: kernels.select_from_histogram_triton(keys, histogram, head.probes))
    out["stage2_greedy_us"] = time_us(lambda: (kernels.reset_greedy_state(*state),
                                               kernels.stage2_greedy_triton(*args, state)))
    if sweep:
        for block_c in (16, 32, 64):
            for warps in (4, 8):
                out[f"sweep_stage1_c{block_c}_w{warps}_us"] = time_us(
                    lambda: kernels.stage1_triton(hidden, head.centroids, None, None, block_c=block_c,
                                                  num_warps=warps))
        for warps in (4, 8, 16):
            out[f"sweep_select_w{warps}_us"] = time_us(
                lambda: kernels.select_from_histogram_triton(keys, histogram, head.probes, warps))
        for block_p in (1, 2, 4):
            for block_h in (256, 1024):
                for warps in (4, 8):
                    out[f"sweep_stage2g_p{block_p}_h{block_h}_w{warps}_us"] = time_us(
                        lambda: kernels.stage2_greedy_triton(*args, state, block_p=block_p, block_h=block_h,
                                                             num_warps=warps))
    return out


def print_head_table(rows: list[dict]) -> None:
    header = ("shape", "batch", "C x S, p", "dense us", "flash us", "ratio", "routed us", "ratio",
              "dense+samp us", "flash+samp us", "routed+samp us", "ratio", "top1 (random w)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['clusters']} x {r['cluster_size']}, {r['probes']} | "
              f"{r['dense_greedy_us']:.1f} | {r['flash_greedy_us']:.1f} | "
              f"{r['dense_greedy_us'] / r['flash_greedy_us']:.2f}x | {r['routed_greedy_us']:.1f} | "
              f"{r['dense_greedy_us'] / r['routed_greedy_us']:.2f}x | {r['dense_sample_us']:.1f} | "
              f"{r['flash_sample_us']:.1f} | {r['routed_sample_us']:.1f} | "
              f"{r['dense_sample_us'] / r['routed_sample_us']:.2f}x | {r['agreement_random']:.3f} |")
    if any("flash_greedy_gpu_us" in r for r in rows):
        print("\nGPU time per call (mean of 10 back-to-back replays, median of 5 groups; greedy):")
        print("| shape | batch | dense us | flash us | ratio |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['batch']} | {r['dense_greedy_gpu_us']:.1f} | {r['flash_greedy_gpu_us']:.1f} | "
                  f"{r['dense_greedy_gpu_us'] / r['flash_greedy_gpu_us']:.2f}x |")
    for r in rows:
        if "stage1_us" in r:
            print(f"{r['shape']} batch {r['batch']}: build {r['build_s']:.1f} s, max_fast_batch "
                  f"{r['max_fast_batch']}; stage1 {r['stage1_us']:.1f} us (with the select histogram "
                  f"{r.get('stage1_histogram_us', float('nan')):.1f} us, zeroing it "
                  f"{r.get('zero_histogram_us', float('nan')):.1f} us), select "
                  f"{r.get('select_us', float('nan')):.1f} us (torch topk {r['topk_us']:.1f} us), stage2 logits "
                  f"{r['stage2_logits_us']:.1f} us, stage2 greedy {r.get('stage2_greedy_us', float('nan')):.1f} us, "
                  f"fast path == torch reference: {r['matches_torch_reference']:.3f}")
            sweep = ", ".join(f"{k[6:-3]}={v:.1f}" for k, v in r.items() if k.startswith("sweep_"))
            if sweep:
                print(f"  sweep (us): {sweep}")


# ------------------------------------------------------------------------------------------- e2e mode

def decode_steps(llm, prompt: list[int], output_len: int, tag: str) -> tuple[list[int], list[float]]:
    """Greedy batch-1 generation; (output ids, per-step seconds of the decode steps)."""
    from pellucid.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.add_request(tag, prompt, params, stream=True)
    steps, output = [], None
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        outs = llm.step()       # ends with the sampled-token readback, so the GPU work is included
        steps.append(time.perf_counter() - start)
        for out in outs:
            output = out
    return list(output.outputs[0].token_ids), steps[1:-1]   # drop the prefill step and the finishing one


def run_e2e(model_name: str, output_len: int, probes: int, cache_root: str) -> list[dict]:
    from pellucid.bench.models import build_random_checkpoint
    from pellucid.config import EngineConfig
    from pellucid.heads.flashhead.cli import read_head_weight
    from pellucid.llm import LLM

    model_dir = build_random_checkpoint(model_name, os.path.join(cache_root, model_name))
    weight = read_head_weight(model_dir).to("cuda", torch.bfloat16)
    start = time.perf_counter()
    asset = save_asset(os.path.join(model_dir, "flashhead"), balanced_spherical_kmeans(weight, device="cuda"), weight)
    build_s = time.perf_counter() - start
    del weight
    prompt = torch.randint(10, 1000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    rows, outputs = [], {}
    for repeat in range(2):   # dense, flash, dense, flash: drift on the machine shows as a spread
        for head, options in (("dense", {}), ("flashhead", {"asset": asset, "probes": probes})):
            config = EngineConfig.from_kwargs(model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=8,
                                              max_num_batched_tokens=1024, gpu_memory_utilization=0.5,
                                              head=head, head_options=options)
            llm = LLM.from_config(config)
            decode_steps(llm, prompt, 8, f"warm-{head}-{repeat}")
            ids, steps = decode_steps(llm, prompt, output_len, f"{head}-{repeat}")
            outputs[head] = ids
            usage = llm.engine.runner.head.usage()
            row = {"model": model_name, "head": head, "repeat": repeat, "output_len": output_len,
                   "median_step_ms": statistics.median(steps) * 1e3,
                   "tokens_per_s": 1.0 / statistics.median(steps), "asset_build_s": build_s, **usage}
            if head == "flashhead":
                row.update(head_only_and_bytes(core.runner.model, core.runner.head))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del core
            torch.cuda.empty_cache()
    agree = sum(a == b for a, b in zip(outputs["dense"], outputs["flashhead"])) / len(outputs["dense"])
    first_diff = next((i for i, (a, b) in enumerate(zip(outputs["dense"], outputs["flashhead"])) if a != b), None)
    print(f"greedy outputs, flashhead vs dense (random weights): {agree:.3f} of positions equal, first "
          f"difference at step {first_diff}")
    return rows


def head_only_and_bytes(model: torch.nn.Module, head: FlashHead) -> dict:
    """What bounds the end-to-end gain of a cheaper head at batch 1: the weight bytes a decode step reads
    (every weight once, the embedding table only one row, unless it is the tied head) with each head, and
    the head-only latency of both inside the engine's own head object (CUDA-graph replays)."""
    head_weight = model.lm_head.weight
    seen, step_bytes = set(), 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.data_ptr() in seen or ("embed" in name and tensor.data_ptr() != head_weight.data_ptr()):
            continue
        seen.add(tensor.data_ptr())
        step_bytes += tensor.numel() * tensor.element_size()
    if head_weight.data_ptr() not in seen:
        step_bytes += head_weight.numel() * head_weight.element_size()
    dense_head_bytes = head_weight.numel() * head_weight.element_size()
    flash_head_bytes = (head.centroids.numel() * head.centroids.element_size()
                        + head.probes * head.cluster_weight[0].numel() * head.cluster_weight.element_size())
    flash_step_bytes = step_bytes - dense_head_bytes + flash_head_bytes
    hidden = torch.randn(1, head_weight.shape[1], device=head_weight.device, dtype=head_weight.dtype)
    with torch.inference_mode():
        dense_us = measure_latency_us(lambda: head.compute_logits(hidden).argmax(dim=1), hidden.device,
                                      cuda_graph=True)
        flash_us = measure_latency_us(lambda: head.greedy(hidden), hidden.device, cuda_graph=True)
    return {"step_weight_bytes_dense": step_bytes, "step_weight_bytes_flash": flash_step_bytes,
            "dense_head_bytes": dense_head_bytes, "flash_head_bytes": flash_head_bytes,
            "bytes_bound": step_bytes / flash_step_bytes, "head_dense_us": dense_us, "head_flash_us": flash_us}


def print_e2e_table(rows: list[dict]) -> None:
    dense = statistics.median(r["tokens_per_s"] for r in rows if r["head"] == "dense")
    dense_ms = statistics.median(r["median_step_ms"] for r in rows if r["head"] == "dense")
    print("| model | head | batch | decode tokens/s (median step, per run) | ratio vs dense |")
    print("|---|---|---|---|---|")
    for head in ("dense", "flashhead"):
        runs = [r["tokens_per_s"] for r in rows if r["head"] == head]
        print(f"| {rows[0]['model']} | {head} | 1 | {statistics.median(runs):.1f} "
              f"({', '.join(f'{t:.1f}' for t in runs)}) | {statistics.median(runs) / dense:.2f}x |")
    flash = next(r for r in rows if r["head"] == "flashhead")
    saved_ms = (flash["head_dense_us"] - flash["head_flash_us"]) / 1e3
    print(f"Bound from bytes: a decode step reads {flash['step_weight_bytes_dense'] / 1e6:.0f} MB of weights "
          f"with the dense head, of which the head {flash['dense_head_bytes'] / 1e6:.0f} MB; FlashHead reads "
          f"{flash['flash_head_bytes'] / 1e6:.1f} MB instead, so even a step at the bandwidth floor gains at "
          f"most {flash['bytes_bound']:.2f}x.")
    print(f"Bound from the measured step: head alone {flash['head_dense_us']:.1f} us dense vs "
          f"{flash['head_flash_us']:.1f} us FlashHead in the engine's head; removing that difference from "
          f"the dense step ({dense_ms:.3f} ms) gives at most {dense_ms / (dense_ms - saved_ms):.2f}x.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--probes", type=int, default=256)
    parser.add_argument("--cluster-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-graph", action="store_true", help="time eager calls instead of CUDA-graph replays")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kernel block-size sweeps")
    parser.add_argument("--e2e", action="store_true", help="end-to-end batch-1 decode through the engine")
    parser.add_argument("--e2e-model", default="Qwen3-0.6B")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"))
    parser.add_argument("--json", default=None, help="write all rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.e2e:
        if device.type != "cuda":
            raise SystemExit("--e2e needs a CUDA device")
        rows = run_e2e(args.e2e_model, args.output_len, args.probes, args.model_cache)
        print(f"\nEnd-to-end greedy decode, batch 1, on {device_name}, bf16, random weights, "
              f"{args.output_len} tokens after a 128-token prompt")
        print_e2e_table(rows)
    else:
        graph = device.type == "cuda" and not args.no_graph
        rows = []
        for name in args.shapes.split(","):
            rows += bench_shape(name, [int(b) for b in args.batches.split(",")], args.probes, args.cluster_size,
                                args.iterations, device, getattr(torch, args.dtype), graph, not args.no_sweep)
        print(f"\nFlashHead head-only latency on {device_name}, {args.dtype}, "
              f"{'CUDA-graph replays, each timed alone' if graph else 'eager'}, median of 200")
        print_head_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
