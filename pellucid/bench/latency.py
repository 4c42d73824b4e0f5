"""`pellucid bench latency`: prefill time and per-token decode time at given batch sizes, against the
weight-bytes floor (weights + KV read per step over the copy bandwidth measured in the same run), and
one long prefill against the bf16 matmul rate.

Mixture-of-experts models: a step's weights are the non-expert ones plus the experts its batch touched,
measured per batch size by a short traced run (pellucid.bench.moe); prefill FLOPs count top_k experts per
token."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pellucid.bench.common import (kv_bytes_per_token, make_engine, prefill_flops, print_table,
                                   random_prompts, weight_bytes_per_step)
from pellucid.bench.floors import measure_floors, print_floors
from pellucid.bench.moe import decode_bytes, is_moe, measure_experts_touched, moe_prefill_flops


def _run_batch(llm, batch: int, input_len: int, output_len: int, seed: int) -> tuple[float, list[float]]:
    """(prefill seconds until every request has its first token, decode step seconds: none for one output token).

    Only steps that decode all `batch` requests count. A chunked prefill gives the requests their first tokens
    in different steps, so the first ones also finish first; steps after that decode fewer requests, and timing
    them would report a smaller batch (64 prompts of 4,096 tokens take 32 prefill steps: with 32 output tokens
    no step decoded all 64)."""
    from pellucid.sampling_params import SamplingParams

    core = llm.engine

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    vocab = core.runner.head.vocab_size
    for i, prompt in enumerate(random_prompts([input_len] * batch, vocab, seed)):
        llm.add_request(f"lat-{batch}-{i}", prompt, params)
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.num_waiting:
        llm.step()
    prefill = time.perf_counter() - start
    steps = []
    while llm.has_unfinished_requests():
        whole_batch = len(core.scheduler.running) == batch
        t0 = time.perf_counter()
        llm.step()      # ends with the sampled-token readback, so the GPU work is included
        if whole_batch:
            steps.append(time.perf_counter() - t0)
    if not steps and output_len > 1:     # one output token (a prefill timing) has no decode step to time
        raise ValueError(f"no decode step ran all {batch} requests: the first ones finished ({output_len} tokens) "
                         f"before the last ones' prompts ({input_len} tokens) were prefilled; ask for more output")
    return prefill, steps[:-1] if len(steps) > 1 else steps


def restage_for_replay(staging, size: int) -> None:
    """Copy the host step arrays' first `size` rows into the device views that the graph of `size` reads.

    The device staging region is laid out per padded size (pellucid.runner.staging): a size's views overlap
    the arrays of every other size. A batch whose requests finish in different steps (chunked prefill gives
    them their first tokens in different steps) ends on a smaller step, whose copy leaves the larger size's
    views holding other arrays' bytes: slot numbers where sequence lengths belong, positions where query
    starts belong. Replaying the larger graph on those reads block-table rows past their width and KV blocks
    past the cache: the illegal memory access `bench latency` hit on Qwen3-30B-A3B at batch 256 (BENCHMARKS.md,
    issue 19). The host arrays keep every row's last values (in range), so copying them again is enough."""
    if staging.device.is_cuda:
        torch.cuda.synchronize()    # the host region is rewritten: the last step's copy must be done
    staging.copy(size, size)


def _graph_forward_seconds(core, batch: int) -> float | None:
    """GPU time of one replay of the decode graph for `batch` alone (no host work), event-timed.

    Run right after that batch's last step, on its requests' step arrays copied again for this size (their
    KV blocks are free by now, but nothing else runs: the replays only read and rewrite them).
    """
    graphs = core.runner.cuda_graphs
    if graphs is None or batch not in graphs.sizes:
        return None
    restage_for_replay(core.runner.buffers.staging, batch)
    longest = int(core.runner.buffers.seq_lens.np[:batch].max())    # the graph those steps replayed
    for _ in range(3):
        graphs.replay(batch, max_seq_len=longest)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graphs.replay(batch, max_seq_len=longest)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20 * 1e-3


def run_latency(args: argparse.Namespace) -> None:
    floors = measure_floors()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_len = max(args.input_len + args.output_len, args.prefill_len + 1) + 16
    budget = max(8192, args.prefill_len, max(batches) * args.input_len // 4)
    llm, model_dir = make_engine(args, max_len, max(batches), budget)
    core = llm.engine
    model = core.runner.model
    weights = weight_bytes_per_step(model)
    kv_token = kv_bytes_per_token(model, core.runner.kv_dtype)
    _run_batch(llm, min(batches), 16, 8, args.seed + 99)    # warm-up: kernel compilation
    moe = is_moe(model)
    timed = []
    for batch in batches:
        prefill, steps = _run_batch(llm, batch, args.input_len, args.output_len, args.seed + batch)
        forward = _graph_forward_seconds(core, batch)
        timed.append((batch, prefill, statistics.median(steps), forward))
    long_prefill = [_run_batch(llm, 1, args.prefill_len, 1, args.seed + 1000 + rep)[0]
                    for rep in range(3 if args.prefill_len else 0)]
    rows = []
    for batch, prefill, step, forward in timed:
        # After all timings: these traced runs capture graph variants of their own.
        mean_context = args.input_len + args.output_len / 2
        step_weights, touched = weights, []
        if moe:
            experts = measure_experts_touched(llm, batch, args.input_len, 8, args.seed + 500 + batch)
            step_weights, touched = decode_bytes(model, weights, experts), [f"{experts:.1f}"]
        floor = floors.bytes_time(step_weights + batch * mean_context * kv_token)
        rows.append([args.model, "eager" if args.enforce_eager else "graphs", str(batch), *touched,
                     f"{step_weights / 1e9:.2f}", f"{prefill * 1e3:.1f}", f"{step * 1e3:.3f}", f"{batch / step:.0f}",
                     "-" if forward is None else f"{forward * 1e3:.3f}", f"{floor * 1e3:.3f}", f"{step / floor:.2f}x"])
    print_floors(floors)
    print(f"\nprompt {args.input_len} tokens, {args.output_len} generated; decode step = median wall time of an "
          "engine step (schedule to token readback); floor = weights read per step + KV at the mean context, over "
          "the copy bandwidth" + ("; experts touched = mean distinct experts per MoE layer per step, measured"
                                  if moe else ""))
    print_table(["model", "mode", "batch", *(["experts touched"] if moe else []), "weights GB/step", "prefill ms",
                 "decode ms/step", "tokens/s", "graph forward ms", "floor ms/step", "step / floor"], rows)
    if args.prefill_len:
        t = statistics.median(long_prefill)
        flops = prefill_flops(model, args.prefill_len) + moe_prefill_flops(model, args.prefill_len)
        rate = flops / t
        print()
        print_table(["model", "prompt tokens", "prefill ms", "TFLOP/s", "matmul TFLOP/s (same run)", "ratio"],
                    [[args.model, str(args.prefill_len), f"{t * 1e3:.1f}", f"{rate / 1e12:.0f}",
                      f"{floors.matmul_flops_per_s / 1e12:.0f}", f"{rate / floors.matmul_flops_per_s:.2f}"]])
