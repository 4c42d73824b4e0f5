"""Host time per decode step with tracing, with the decoder layers' compute stubbed out.

On a GPU with CUDA graphs a decode step's device time is small, so a traced step's host work (filling
the taps, recording saves, assembling each request's saves when it finishes) decides traced
throughput. This measures that host work on the CPU for three workloads in one run:

- untraced;
- every request saves one layer's output (every position, prompt and generated);
- every request adds a steering vector at one layer's output.

    python benchmarks/trace_step_overhead.py --batch 64 --batch 256 --output-len 64 --repeats 3

The model is the tiny random qwen3 (hidden 64) with every decoder layer's forward replaced by the
identity: the module tree stays, so tracing hooks fire on the real modules, while the step costs no
attention or MLP compute. Embedding, final norm, LM head (vocab 512) and sampler still run, as in
benchmarks/step_overhead.py. A run prefills every request, then times each decode step until all
requests finish (the last step includes assembling every request's saves). Times are the main
thread's CPU time (`--clock cpu`, the default: other processes on a busy machine barely move it; torch
runs one thread) or wall time (`--clock wall`). Steps run serially (the CPU default; on a GPU steps
are launched ahead and host work overlaps device work), traced and untraced alike, so the ratio
compares host work only. With --freeze-gc (the default) the heap built at start-up (modules,
weights, tokenizer) is moved out of the cyclic GC's view after warm-up, as a server would do: otherwise
a full collection (~150-200 ms of CPU here) lands in a random step of any workload. CPU device: host-to-device copies and pinned-memory staging are
no-ops here, so their cost on a GPU is not in these figures.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch


def stub_decoder_layers(model: torch.nn.Module) -> int:
    """Replace each decoder layer's compute by the identity, keeping the module (and its hooks)."""
    layers = model.model.layers
    for layer in layers:
        layer.forward = lambda residual: residual
        layer.forward_fused = lambda residual, normed, next_norm: (residual, None)
    return len(layers)


def build_engine(batch: int, prompt_len: int, output_len: int) -> Any:
    from pellucid.config import EngineConfig
    from pellucid.llm import LLM
    from pellucid.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen3", tempfile.mkdtemp(prefix="trace-step-overhead-"), num_hidden_layers=4,
                                 max_position_embeddings=4096)
    max_len = prompt_len + output_len + 8
    config = EngineConfig.from_kwargs(model_dir, device="cpu", max_num_seqs=batch, max_model_len=max_len,
                                      max_num_batched_tokens=max(batch * prompt_len, 2048),
                                      num_kv_blocks=batch * (max_len // 16 + 2), async_scheduling=False,
                                      enable_prefix_caching=False)
    llm = LLM.from_config(config)
    stub_decoder_layers(llm.engine.runner.model)
    return llm


def make_extras(workload: str, site: str, vector: torch.Tensor) -> dict[str, Any] | None:
    from pellucid.tracing import Add, Save, TracePlan

    if workload == "untraced":
        return None
    if workload == "save":
        return {"trace": TracePlan([Save(site=site)])}
    if workload == "add":
        return {"trace": TracePlan([Add(site=site, value=vector)])}
    raise ValueError(workload)


class PhaseTimer:
    """Adds up the time spent in wrapped functions (the tracing parts of a step), per name."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.active = False         # counts only while decode steps are being timed

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return inner(*args, **kwargs)
            t0 = CLOCK()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + CLOCK() - t0
        setattr(owner, attribute, timed)


def wrap_tracing_phases(timer: PhaseTimer) -> None:
    from pellucid.tracing.feature import EngineTracing
    from pellucid.tracing.hooks import StepTrace
    from pellucid.tracing.taps import TargetTap

    timer.wrap(StepTrace, "for_step", "StepTrace.for_step (find traced rows, build or advance)")
    timer.wrap(StepTrace, "prepare", "StepTrace.prepare (fill taps, host-to-device)")
    timer.wrap(TargetTap, "apply", "TargetTap.apply (hook: edit + save gather)")
    timer.wrap(StepTrace, "apply_logits_ops", "StepTrace.apply_logits_ops")
    timer.wrap(StepTrace, "record_tokens", "StepTrace.record_tokens")
    timer.wrap(StepTrace, "finish_step", "StepTrace.finish_step")
    timer.wrap(EngineTracing, "after_step", "Tracing.after_step (assemble saves)")


CLOCK = time.thread_time


TIMER = PhaseTimer()


def run_once(llm: Any, workload: str, batch: int, prompt_len: int, output_len: int, seed: int,
             profiler: cProfile.Profile | None) -> list[float]:
    """Add `batch` requests, prefill them, then time every decode step until all finish."""
    from pellucid.sampling_params import SamplingParams

    core = llm.engine
    hidden = core.hf_config.hidden_size
    site = f"model.layers.{core.hf_config.num_hidden_layers // 2}"
    gen = torch.Generator().manual_seed(seed)
    vector = torch.randn(hidden, generator=gen) * 0.1
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = torch.randint(10, 500, (prompt_len,), generator=gen).tolist()
        llm.add_request(f"{workload}-{seed}-{i}", prompt, params, extras=make_extras(workload, site, vector))
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
        llm.step()
    times = []
    finished = 0
    while llm.has_unfinished_requests():
        if profiler:
            profiler.enable()
        TIMER.active = True
        t0 = CLOCK()
        outs = llm.step()
        times.append(CLOCK() - t0)
        TIMER.active = False
        if profiler:
            profiler.disable()
        for out in outs:
            if out.finished:
                finished += 1
                assert out.error is None, out.error
                if workload == "save":
                    saved = out.extras["saves"][f"{site}.output"]
                    assert saved.shape == (prompt_len + output_len - 1, hidden), saved.shape
    assert finished == batch, f"{finished} of {batch} requests finished"
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, action="append", help="decode batch size (repeatable; default 64, 256)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per workload, interleaved; median reported")
    parser.add_argument("--workloads", default="untraced,save,add")
    parser.add_argument("--profile", default=None, help="cProfile this workload (save or add) and print the top")
    parser.add_argument("--phases", action="store_true", help="time the tracing parts of the step, per workload")
    parser.add_argument("--freeze-gc", action=argparse.BooleanOptionalAction, default=True,
                        help="gc.freeze() after warm-up, so full collections skip the start-up heap")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="the main thread's CPU time (robust to other load) or wall time")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    workloads = args.workloads.split(",")
    timer = TIMER
    if args.phases:
        wrap_tracing_phases(timer)
    print("| batch | workload | host ms/step (mean, incl. finish) | median | max step | vs untraced (mean) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in args.batch or [64, 256]:
        llm = build_engine(batch, args.prompt_len, args.output_len)
        timer.totals = {}
        for workload in workloads:     # warm-up: first captures, site probes, allocator
            run_once(llm, workload, min(batch, 4), args.prompt_len, 4, seed=999, profiler=None)
        if args.freeze_gc:
            gc.collect()
            gc.freeze()
        results: dict[str, list[list[float]]] = {w: [] for w in workloads}
        phase_totals: dict[str, dict[str, float]] = {}
        profiler = cProfile.Profile() if args.profile else None
        for repeat in range(args.repeats):
            for workload in workloads:
                prof = profiler if workload == args.profile else None
                timer.totals = phase_totals.setdefault(workload, {})
                results[workload].append(run_once(llm, workload, batch, args.prompt_len, args.output_len,
                                                  seed=repeat, profiler=prof))
        means = {w: statistics.median(statistics.mean(t) for t in runs) * 1e3 for w, runs in results.items()}
        base = means.get("untraced")
        for workload, runs in results.items():
            median = statistics.median(statistics.median(t) for t in runs) * 1e3
            worst = statistics.median(max(t) for t in runs) * 1e3
            ratio = f"{means[workload] / base:.2f}x" if base else "-"
            print(f"| {batch} | {workload} | {means[workload]:.3f} | {median:.3f} | {worst:.2f} | {ratio} |")
        for workload, totals in phase_totals.items():
            steps = sum(len(t) for t in results[workload])
            for name, total in totals.items():
                print(f"|   | {workload}: {name} | {total / steps * 1e3:.3f} | | | |")
        if profiler:
            print(f"\nprofile of {args.profile}, batch {batch}:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
