"""Tensor parallelism on several GPUs (issue 21): decode step time at TP = 1, 2, 4 against TP = 1 and
against the per-GPU weight floor, the offline throughput workload, and the step's all-reduces against
NCCL's bandwidth for their message size, each measured in the same run.

    python benchmarks/tp_bench.py decode --model Llama-3.1-8B --tp-sizes 1,2,4
    python benchmarks/tp_bench.py decode --model Llama-3.1-70B --tp-sizes 4
    python benchmarks/tp_bench.py throughput --model Llama-3.1-70B --tp-size 4
    python benchmarks/tp_bench.py allreduce --model Llama-3.1-8B --tp-sizes 2,4

decode: one request (or --batch), --input-len prompt tokens, --output-len greedy tokens; the decode step
time is the engine core's own mean step time over the decode steps (EngineStats: schedule, launch,
collect, outputs; what a request waits per token), the floor the weights one GPU reads per step (its
shard) over the copy bandwidth measured first in this process. The engine core runs in its own process
(rank 0) with one worker process per other rank, as `pellucid serve --tensor-parallel-size N` runs it.

allreduce: N processes (NCCL) time the all-reduce of one decode step's message ([batch, hidden] in the
model dtype) inside a CUDA graph of 2 x layers all-reduces (as the step's graph holds them) and eagerly,
and a 256 MiB all-reduce for the bus bandwidth NCCL reaches on these GPUs; bus bandwidth = size / time x
2 (N - 1) / N, NCCL's own definition.

On the CPU (--device cpu, a model directory) every section runs with gloo, to check the script itself.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pellucid.bench.common import print_table, random_prompts  # noqa: E402
from pellucid.bench.models import NAMED_CONFIGS, resolve_model, tensor_shapes  # noqa: E402


def model_config(model_dir: str) -> dict:
    import json
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def weight_bytes_per_gpu(config: dict, tp: int, elem: int = 2) -> float:
    """Weights one rank reads per decode step: its shard of every parameter (norms whole), the input
    embedding excepted when untied (a step reads only its tokens' rows)."""
    total = 0.0
    for name, shape in tensor_shapes(config).items():
        if name == "model.embed_tokens.weight" and not config.get("tie_word_embeddings"):
            continue
        n = 1
        for s in shape:
            n *= s
        total += n * elem / (tp if len(shape) > 1 else 1)
    return total


def start_engine(args: argparse.Namespace, model_dir: str, tp: int, max_num_seqs: int):
    from pellucid import LLM
    return LLM(model_dir, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
               max_model_len=args.input_len + args.output_len + 16, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(2048, args.input_len * max_num_seqs), enforce_eager=args.enforce_eager,
               gpu_memory_utilization=args.gpu_memory_utilization, engine_process=True)


def timed_generate(llm, prompts: list[list[int]], output_len: int) -> tuple[float, float, int]:
    """(wall seconds, engine step seconds, engine steps) of one generate call."""
    from pellucid import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    before = llm.client.latest_stats
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.client.latest_stats
    return wall, after.step_seconds - before.step_seconds, after.num_steps - before.num_steps


def run_decode(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model, args.model_cache)
    config = model_config(model_dir)
    copy_bw = None
    if args.device != "cpu":
        from pellucid.bench.floors import measure_floors, print_floors
        floors = measure_floors()
        copy_bw = floors.copy_bytes_per_s
        print_floors(floors)
        torch.cuda.empty_cache()
    rows, base = [], None
    for tp in [int(t) for t in args.tp_sizes.split(",")]:
        llm = start_engine(args, model_dir, tp, args.batch)
        prompts = random_prompts([args.input_len] * args.batch, config["vocab_size"], args.seed)
        timed_generate(llm, prompts, 8)     # warm-up: kernels, graphs
        per_step = []
        for rep in range(args.repeats):
            # Decode alone: a run of output_len tokens minus a run of 1 (the prefill and the first token).
            _, full_s, full_n = timed_generate(llm, prompts, args.output_len)
            _, pre_s, pre_n = timed_generate(llm, prompts, 1)
            per_step.append((full_s - pre_s) / max(1, full_n - pre_n))
        llm.shutdown()
        step = statistics.median(per_step)
        base = step if tp == 1 or base is None else base
        floor = weight_bytes_per_gpu(config, tp) / copy_bw if copy_bw else None
        rows.append([args.model, str(tp), str(args.batch), f"{step * 1e3:.3f}",
                     f"{step / base:.2f}x" if base else "-", "-" if floor is None else f"{floor * 1e3:.3f}",
                     "-" if floor is None else f"{step / floor:.2f}x"])
    print(f"\nbatch {args.batch}, prompt {args.input_len}, {args.output_len} greedy tokens; decode ms/step = median over "
          f"{args.repeats} runs of the engine core's mean decode step; vs first = against the first TP size listed "
          "(measured in this run); floor = one GPU's shard of the weights over the copy bandwidth")
    print_table(["model", "TP", "batch", "decode ms/step", "vs first", "per-GPU weight floor ms", "step / floor"], rows)


def run_throughput(args: argparse.Namespace) -> None:
    from pellucid.bench.throughput import workload
    model_dir = resolve_model(args.model, args.model_cache)
    config = model_config(model_dir)
    inputs, outputs = workload(args.num_requests, args.min_len, args.max_len, args.seed)
    args.input_len, args.output_len = max(inputs), max(outputs)
    llm = start_engine(args, model_dir, args.tp_size, args.max_num_seqs)
    prompts = random_prompts(inputs, config["vocab_size"], args.seed)
    timed_generate(llm, prompts[:4], 8)
    from pellucid import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in outputs]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    print_table(["model", "TP", "requests", "output tokens", "seconds", "output tok/s", "total tok/s"],
                [[args.model, str(args.tp_size), str(len(prompts)), str(sum(outputs)), f"{elapsed:.1f}",
                  f"{sum(outputs) / elapsed:.0f}", f"{(sum(inputs) + sum(outputs)) / elapsed:.0f}"]])


def _allreduce_rank(rank: int, size: int, init: str, message_elems: int, layers: int, dtype: torch.dtype,
                    device_type: str, results: dict) -> None:
    import torch.distributed as dist
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init, rank=rank, world_size=size)
    x = torch.randn(message_elems, dtype=dtype, device=device)
    big = torch.randn((256 << 20) // x.element_size(), dtype=dtype, device=device)

    def timed(fn, repeats: int) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(5):
            if device_type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e-3 / repeats)
            else:
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                samples.append((time.perf_counter() - t0) / repeats)
        return statistics.median(samples)

    eager = timed(lambda: dist.all_reduce(x), 50)
    graphed = None
    if device_type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(2 * layers):
                dist.all_reduce(x)
        graphed = timed(graph.replay, 5) / (2 * layers)
    large = timed(lambda: dist.all_reduce(big), 5)
    if rank == 0:
        results.update(eager=eager, graphed=graphed, large=large, big_bytes=big.numel() * big.element_size())
    dist.barrier()
    dist.destroy_process_group()


def run_allreduce(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    model_dir = resolve_model(args.model, args.model_cache) if args.model not in NAMED_CONFIGS else None
    config = NAMED_CONFIGS.get(args.model) or model_config(model_dir)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") and args.device != "cpu" else torch.float32
    rows = []
    for size in [int(t) for t in args.tp_sizes.split(",") if int(t) > 1]:
        manager = mp.Manager()
        results = manager.dict()
        store = tempfile.mktemp(prefix="pellucid-allreduce-")
        mp.spawn(_allreduce_rank, args=(size, f"file://{store}", args.batch * hidden, layers, dtype,
                                        "cpu" if args.device == "cpu" else "cuda", results), nprocs=size, join=True)
        msg = args.batch * hidden * torch.empty((), dtype=dtype).element_size()
        factor = 2 * (size - 1) / size
        per = results["graphed"] if results["graphed"] is not None else results["eager"]
        bus_small = msg / per * factor
        bus_large = results["big_bytes"] / results["large"] * factor
        rows.append([args.model, str(size), str(msg), f"{results['eager'] * 1e6:.1f}",
                     "-" if results["graphed"] is None else f"{results['graphed'] * 1e6:.1f}",
                     f"{2 * layers * per * 1e3:.3f}", f"{bus_small / 1e9:.2f}", f"{bus_large / 1e9:.1f}",
                     f"{msg * factor / bus_large * 1e6:.2f}"])
    print(f"\none decode step at batch {args.batch}: 2 x {layers} all-reduces of [batch, {hidden}] "
          f"({dtype}); bus GB/s = size / time x 2(N-1)/N; 'at 256 MiB busbw' = the time that message would take "
          "at the large-message bus bandwidth (the bandwidth-only bound)")
    print_table(["model", "N", "message bytes", "eager us", "in graph us", "step all-reduces ms",
                 "bus GB/s at this size", "bus GB/s at 256 MiB", "us at 256 MiB busbw"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=("decode", "throughput", "allreduce"))
    parser.add_argument("--model", default="Llama-3.1-8B",
                        help=f"a named random-weight shape ({', '.join(NAMED_CONFIGS)}) or a model directory")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"))
    parser.add_argument("--tp-sizes", default="1,2,4")
    parser.add_argument("--tp-size", type=int, default=4, help="throughput: the TP size")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="throughput: shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="throughput: longest prompt and output")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    {"decode": run_decode, "throughput": run_throughput, "allreduce": run_allreduce}[args.section](args)


if __name__ == "__main__":
    main()
