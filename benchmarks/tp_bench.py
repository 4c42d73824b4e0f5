"""Tensor parallelism on several GPUs (issue 21): decode step time at TP = 1, 2, 4 against TP = 1 and
against the per-GPU weight floor, the offline throughput workload, and the step's all-reduces against
NCCL's bandwidth for their message size, each measured in the same run.

    python benchmarks/tp_bench.py decode --model Llama-3.1-8B --tp-sizes 1,2,4 --all-reduce nccl,symm_mem
    python benchmarks/tp_bench.py decode --model Llama-3.1-70B --tp-sizes 4
    python benchmarks/tp_bench.py throughput --model Llama-3.1-70B --tp-size 4
    python benchmarks/tp_bench.py allreduce --model Llama-3.1-8B --tp-sizes 2,4

decode: one request (or --batch), --input-len prompt tokens, --output-len greedy tokens; the decode step
time is the engine core's own mean step time over the decode steps (EngineStats: schedule, launch,
collect, outputs; what a request waits per token), the floor the weights one GPU reads per step (its
shard) over the copy bandwidth measured first in this process. The engine core runs in its own process
(rank 0) with one worker process per other rank, as `pellucid serve --tensor-parallel-size N` runs it.

allreduce: N processes time the all-reduce of a decode step's message ([batch, hidden] in the model dtype,
at each of --allreduce-batches) with NCCL and with the symmetric-memory one-shot kernel (--all-reduce
symm_mem), eagerly and inside a CUDA graph of 2 x layers all-reduces (as the step's graph holds them), and
a 256 MiB NCCL all-reduce for the bus bandwidth NCCL reaches on these GPUs; bus bandwidth = size / time x
2 (N - 1) / N, NCCL's own definition. Each rank prints its progress as it goes.

decode --all-reduce nccl,symm_mem runs every TP size above 1 once with each all-reduce, in the same run.

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


def start_engine(args: argparse.Namespace, model_dir: str, tp: int, max_num_seqs: int, all_reduce: str = "nccl"):
    from pellucid import LLM
    print(f"starting the engine: TP={tp}, all-reduce {all_reduce}", flush=True)
    return LLM(model_dir, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
               max_model_len=args.input_len + args.output_len + 16, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(2048, args.input_len * max_num_seqs), enforce_eager=args.enforce_eager,
               gpu_memory_utilization=args.gpu_memory_utilization, engine_process=True, all_reduce=all_reduce)


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
    # TP=1 has no all-reduce: one engine; each TP > 1 once per all-reduce asked for.
    runs = [(tp, all_reduce) for tp in [int(t) for t in args.tp_sizes.split(",")]
            for all_reduce in (["-"] if tp == 1 else args.all_reduce.split(","))]
    for tp, all_reduce in runs:
        llm = start_engine(args, model_dir, tp, args.batch, "nccl" if all_reduce == "-" else all_reduce)
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
        print(f"TP={tp} all-reduce {all_reduce}: {step * 1e3:.3f} ms/step", flush=True)
        base = step if tp == 1 or base is None else base
        floor = weight_bytes_per_gpu(config, tp) / copy_bw if copy_bw else None
        rows.append([args.model, str(tp), all_reduce, str(args.batch), f"{step * 1e3:.3f}",
                     f"{step / base:.2f}x" if base else "-", "-" if floor is None else f"{floor * 1e3:.3f}",
                     "-" if floor is None else f"{step / floor:.2f}x"])
    print(f"\nbatch {args.batch}, prompt {args.input_len}, {args.output_len} greedy tokens; decode ms/step = median over "
          f"{args.repeats} runs of the engine core's mean decode step; vs first = against the first TP size listed "
          "(measured in this run); floor = one GPU's shard of the weights over the copy bandwidth; all-reduce = "
          "--all-reduce of the TP engine (symm_mem falls back to NCCL, logged, where it cannot run)")
    print_table(["model", "TP", "all-reduce", "batch", "decode ms/step", "vs first", "per-GPU weight floor ms",
                 "step / floor"], rows)


def run_throughput(args: argparse.Namespace) -> None:
    from pellucid.bench.throughput import workload
    model_dir = resolve_model(args.model, args.model_cache)
    config = model_config(model_dir)
    inputs, outputs = workload(args.num_requests, args.min_len, args.max_len, args.seed)
    args.input_len, args.output_len = max(inputs), max(outputs)
    llm = start_engine(args, model_dir, args.tp_size, args.max_num_seqs, args.all_reduce.split(",")[0])
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


def _log(rank: int, message: str) -> None:
    """Progress, flushed at once: a run cut off by its time limit shows how far each rank got."""
    print(f"[allreduce rank {rank}, {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _time_s(fn, repeats: int, cuda: bool) -> float:
    """Seconds per call of fn: median of 5 groups of `repeats` calls (CUDA events on the GPU), after 3."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        if cuda:
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


def _in_graph_s(all_reduce, x: torch.Tensor, count: int) -> float:
    """Seconds per all-reduce inside a CUDA graph of `count` of them (as a decode step's graph holds them),
    warmed up on a side stream first, as torch asks before a capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            all_reduce(x)
    return _time_s(graph.replay, 5, True) / count


def _allreduce_rank(rank: int, size: int, init: str, sizes: list[int], layers: int, dtype: torch.dtype,
                    device_type: str, out_path: str) -> None:
    """Every rank runs the same collectives in the same order (or all would wait): NCCL's all-reduce and
    the symmetric-memory one (pellucid/distributed/symm_mem_all_reduce.py, where it can run) at each size,
    eagerly and in a CUDA graph, then NCCL at 256 MiB. Rank 0 writes the times to out_path."""
    import json

    import torch.distributed as dist

    from pellucid.distributed.parallel_state import init_tensor_parallel
    from pellucid.distributed.symm_mem_all_reduce import symm_mem_all_reduce
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    _log(rank, f"joining the group on {device}")
    # The engine's own set-up: NCCL bound to this rank's GPU (device_id), its communicator made now.
    tp = init_tensor_parallel(rank, size, device, init, timeout_s=60)
    _log(rank, "joined; setting up the symmetric-memory all-reduce")
    symm = symm_mem_all_reduce(tp, max_bytes=max(sizes))
    _log(rank, f"symm_mem {'ready' if symm is not None else 'unavailable (see the log)'}")

    def nccl(x: torch.Tensor) -> None:
        dist.all_reduce(x, group=tp.group)
    results: dict = {"sizes": {}}
    for nbytes in sizes:
        x = torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
        row = {"nccl_eager": _time_s(lambda: nccl(x), 50, cuda)}
        if cuda:
            row["nccl_graph"] = _in_graph_s(nccl, x, 2 * layers)
        if symm is not None and symm.accepts(x):
            row["symm_eager"] = _time_s(lambda: symm(x), 50, cuda)
            row["symm_graph"] = _in_graph_s(symm, x, 2 * layers)
        results["sizes"][nbytes] = row
        _log(rank, f"{nbytes} bytes: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row.items()))
    big = torch.zeros((256 << 20) // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    results["large_s"] = _time_s(lambda: nccl(big), 5, cuda)
    results["large_bytes"] = big.numel() * big.element_size()
    _log(rank, f"256 MiB: {results['large_s'] * 1e3:.2f} ms")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    tp.all_gather_object(None)      # every rank done (on gloo) before any leaves
    # Out without destroying the process group: NCCL's teardown after graph captures can hang (pytorch
    # issue 115388), and the process ends here anyway.
    sys.stdout.flush()
    os._exit(0)


def run_allreduce(args: argparse.Namespace) -> None:
    import json

    import torch.multiprocessing as mp
    model_dir = resolve_model(args.model, args.model_cache) if args.model not in NAMED_CONFIGS else None
    config = NAMED_CONFIGS.get(args.model) or model_config(model_dir)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") and args.device != "cpu" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    batches = [int(b) for b in args.allreduce_batches.split(",")]
    sizes = [b * hidden * elem for b in batches]
    rows = []
    for size in [int(t) for t in args.tp_sizes.split(",") if int(t) > 1]:
        work = tempfile.mkdtemp(prefix="pellucid-allreduce-")
        out_path = os.path.join(work, "results.json")
        print(f"allreduce: starting {size} ranks", flush=True)
        mp.spawn(_allreduce_rank, args=(size, f"file://{work}/store", sizes, layers, dtype,
                                        "cpu" if args.device == "cpu" else "cuda", out_path), nprocs=size, join=True)
        with open(out_path) as f:
            results = json.load(f)
        factor = 2 * (size - 1) / size
        bus_large = results["large_bytes"] / results["large_s"] * factor

        def us(row: dict, key: str) -> str:
            return f"{row[key] * 1e6:.1f}" if key in row else "-"
        for batch, nbytes in zip(batches, sizes):
            row = results["sizes"][str(nbytes)]
            nccl = row.get("nccl_graph", row["nccl_eager"])
            symm = row.get("symm_graph")
            rows.append([args.model, str(size), str(batch), str(nbytes), us(row, "nccl_eager"), us(row, "nccl_graph"),
                         us(row, "symm_eager"), us(row, "symm_graph"),
                         "-" if symm is None else f"{symm / nccl:.2f}",
                         f"{2 * layers * nccl * 1e3:.3f}", "-" if symm is None else f"{2 * layers * symm * 1e3:.3f}",
                         f"{nbytes / nccl * factor / 1e9:.2f}", f"{nbytes * factor / bus_large * 1e6:.2f}"])
        rows.append([args.model, str(size), "-", str(results["large_bytes"]), "-", "-", "-", "-", "-", "-", "-",
                     f"{bus_large / 1e9:.1f}", "-"])
    print(f"\nall-reduce of [batch, {hidden}] ({dtype}), NCCL against the symmetric-memory one-shot (--all-reduce "
          f"symm_mem); 'in graph' = per all-reduce inside a CUDA graph of 2 x {layers} (a decode step's); step ms = "
          "2 x layers all-reduces; bus GB/s = size / time x 2(N-1)/N (NCCL's, in graph where measured), last row "
          "256 MiB; 'us at 256 MiB busbw' = the bandwidth-only bound for that message")
    print_table(["model", "N", "batch", "message bytes", "NCCL eager us", "NCCL in graph us", "symm_mem eager us",
                 "symm_mem in graph us", "symm/NCCL in graph", "step all-reduces ms NCCL",
                 "step all-reduces ms symm_mem", "NCCL bus GB/s", "us at 256 MiB busbw"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=("decode", "throughput", "allreduce"))
    parser.add_argument("--model", default="Llama-3.1-8B",
                        help=f"a named random-weight shape ({', '.join(NAMED_CONFIGS)}) or a model directory")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"))
    parser.add_argument("--tp-sizes", default="1,2,4")
    parser.add_argument("--tp-size", type=int, default=4, help="throughput: the TP size")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--all-reduce", default="nccl",
                        help="decode: the all-reduces to run TP > 1 with, comma-separated (nccl, symm_mem), each on "
                             "its own engine in this run; throughput: the first")
    parser.add_argument("--allreduce-batches", default="1,8,32,128,512",
                        help="allreduce: the decode batch sizes whose [batch, hidden] messages are timed")
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
