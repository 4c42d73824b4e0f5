"""Cost of tracing: one batch untraced, with every request saving one layer's output, and with every
request adding a steering vector at one layer, measured in the same run.

    python benchmarks/tracing_bench.py [--model DIR] [--device auto] [--num-prompts 32] [--output-len 64]
                                       [--repeats 3] [--layer N]

The prefix cache is off unless --enable-prefix-caching: the repeats resend the same prompts, and only
untraced requests read the cache (a traced request computes every prompt position itself).
Prints output tokens/s (median of --repeats; the three workloads are interleaved within each repeat)
and the ratio to untraced: the median over repeats of each repeat's ratio, with every repeat's ratio.
One full pass of each workload runs first (kernel compilation, graph captures with the taps).
Without --model it uses the embedded default model (pellucid-debian-13m).
On a GPU, decode steps whose ops are all taps (save, add, ... ; pellucid/tracing/taps.py) replay CUDA
graphs captured with those taps, like untraced steps; the last line says how many replays had taps.

--breakdown adds, per workload, the wall time of each engine phase summed over one generate (median over
the repeats, and the worst repeat), the engine steps by
kind (prefill / decode replay / decode tap replay / decode eager) and the time in Python's GC.
--profile-steps N profiles N steady decode steps of each workload with torch.profiler (CPU and CUDA):
GPU kernel time and count per step, and the CPU ops and CUDA API calls that cost the most host time.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import pstats
import statistics
import time
from typing import Any, Callable, Iterator

import torch

from pellucid import LLM, SamplingParams
from pellucid.tracing import Add, Save, TracePlan


def workload(num_prompts: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 129, (num_prompts,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams,
          extras: Callable[[], list[dict[str, Any] | None]]) -> float:
    batch_extras = extras()
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, extras=batch_extras)
    elapsed = time.perf_counter() - start
    assert all(o.error is None and len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return len(prompts) * params.max_tokens / elapsed


class PhaseClock:
    """Wall time per engine phase, summed per generate, by wrapping the methods that run each phase."""

    def __init__(self) -> None:
        self.runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        self.steps: dict[str, list[dict[str, list[float]]]] = collections.defaultdict(list)
        self.current: dict[str, float] | None = None
        self.current_steps: dict[str, list[float]] | None = None
        self.order: list[str] = []
        self._gc_start = 0.0
        self._step_kind = ""

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)
        self.order.append(name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.current is None:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0
        setattr(owner, attribute, timed)

    def install(self, llm: LLM) -> None:
        import pellucid.runner.model_runner as model_runner_module
        import pellucid.tracing.plan as plan_module
        from pellucid.tracing.feature import EngineTracing
        from pellucid.tracing.hooks import StepTrace

        core = llm.engine
        runner = core.runner
        self.wrap(core, "add_request", "add_request")
        self.wrap(core, "step", "step")
        self.wrap(core, "_schedule", "  schedule")
        self.wrap(runner, "launch", "  runner.launch")
        self.wrap(StepTrace, "for_step", "    StepTrace.for_step")
        if runner.cuda_graphs is not None:
            self.wrap(runner.cuda_graphs, "ensure_variant", "    ensure_variant (tap graph captures)")
            self.wrap(runner.cuda_graphs, "replay", "    graph replay")
        self.wrap(model_runner_module, "build_step_batch", "    build_step_batch")
        self.wrap(StepTrace, "prepare", "    StepTrace.prepare")
        self.wrap(StepTrace, "after_replay", "    StepTrace.after_replay")
        self.wrap(runner, "_forward", "    eager forward")
        self.wrap(runner, "_launch_sampling", "    head + sampler launch")
        self.wrap(runner, "collect", "  runner.collect (waits for the GPU)")
        self.wrap(core.scheduler, "update_from_output", "  update_from_output")
        self.wrap(EngineTracing, "after_step", "  Tracing.after_step (finalize saves)")
        self.wrap(plan_module, "_gather_group", "    _gather_group (assemble saves)")
        self.wrap(plan_module, "_to_host_per_save", "      _to_host_per_save (copy + sync)")
        self.wrap(llm.output_processor, "process", "  frontend output processing")
        self.order.append("gc")
        gc.callbacks.append(self._gc)
        # Steps by kind: what the launch did, and the step's wall time.
        launch = runner.launch
        graphs = runner.cuda_graphs

        def kind_of_launch(so: Any) -> Any:
            before = (graphs.num_replays, graphs.num_tap_replays) if graphs is not None else (0, 0)
            result = launch(so)
            after = (graphs.num_replays, graphs.num_tap_replays) if graphs is not None else (0, 0)
            decode = so.total_num_scheduled_tokens == so.num_reqs
            self._step_kind = ("prefill/mixed" if not decode else "decode tap replay" if after[1] > before[1]
                               else "decode replay" if after[0] > before[0] else "decode eager")
            return result
        runner.launch = kind_of_launch
        step = core.step

        def timed_step() -> Any:
            self._step_kind = "no launch"
            t0 = time.perf_counter()
            result = step()
            if self.current_steps is not None:
                self.current_steps.setdefault(self._step_kind, []).append(time.perf_counter() - t0)
            return result
        core.step = timed_step

    def _gc(self, phase: str, _info: dict[str, Any]) -> None:
        if self.current is None:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.current["gc"] = self.current.get("gc", 0.0) + time.perf_counter() - self._gc_start

    @contextlib.contextmanager
    def measure(self, workload: str) -> Iterator[None]:
        self.current, self.current_steps = {}, {}
        try:
            yield
        finally:
            self.runs[workload].append(self.current)
            self.steps[workload].append(self.current_steps)
            self.current = self.current_steps = None

    def report(self) -> None:
        names = list(self.runs)
        print("\nphase wall ms per generate, median (worst) over repeats")
        print(f"{'phase':<44}" + "".join(f"{n[:22]:>24}" for n in names))
        for phase in self.order:
            cells = []
            for n in names:
                values = [run.get(phase, 0.0) * 1e3 for run in self.runs[n]]
                cells.append(f"{statistics.median(values):.1f} ({max(values):.1f})")
            print(f"{phase:<44}" + "".join(f"{c:>24}" for c in cells))
        print("\nsteps per generate by kind: count, median ms, total ms (median over repeats)")
        kinds = sorted({k for n in names for run in self.steps[n] for k in run})
        for kind in kinds:
            cells = []
            for n in names:
                runs = [run.get(kind, []) for run in self.steps[n]]
                count = statistics.median(len(r) for r in runs)
                med = statistics.median(statistics.median(r) * 1e3 if r else 0.0 for r in runs)
                total = statistics.median(sum(r) * 1e3 for r in runs)
                cells.append(f"{count:.0f} x {med:.2f} = {total:.1f}")
            print(f"{kind:<44}" + "".join(f"{c:>24}" for c in cells))


def profile_decode_steps(llm: LLM, prompts: list[list[int]], name: str, extras: list[dict[str, Any] | None],
                         num_steps: int, trace_dir: str | None) -> None:
    """torch.profiler (CPU, and CUDA on a GPU) over `num_steps` decode steps once every request decodes; then the rest
    of the generation runs unprofiled. Prints GPU time and kernels per step, and the top host costs."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine
    cuda = core.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 8, ignore_eos=True)
    for i, (prompt, ex) in enumerate(zip(prompts, extras)):
        llm.add_request(f"profile-{name}-{i}", prompt, params, ex)
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
        llm.step()
    for _ in range(2):
        llm.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            llm.step()
        sync()
        wall = time.perf_counter() - t0
    python_profile = cProfile.Profile()     # then the same number of steps under cProfile: Python hot spots
    python_profile.enable()
    for _ in range(num_steps):
        llm.step()
    sync()
    python_profile.disable()
    while llm.has_unfinished_requests():
        llm.step()
    kernels = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
    gpu_us = sum(e.device_time for e in kernels) / num_steps
    print(f"\n[{name}] {num_steps} decode steps, batch {len(prompts)}: {wall / num_steps * 1e3:.2f} ms/step wall "
          f"(profiled), GPU {gpu_us:.0f} us/step in {len(kernels) / num_steps:.0f} kernels/memcpys per step")
    _print_top("host op (self CPU)", [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU],
               lambda e: e.self_cpu_time_total, 14, num_steps)
    _print_top("GPU kernel / copy", kernels, lambda e: e.device_time, 6, num_steps)
    stats = pstats.Stats(python_profile).stats      # (file, line, function) -> (cc, ncalls, tottime, cumtime, _)
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    print(f"  {'Python function (cProfile tottime)':<58}{'calls/step':>11}{'us/step':>9}")
    for (file, line, func), (_, ncalls, tottime, _, _) in top:
        where = f"{file.rsplit('/', 1)[-1]}:{line} {func}"
        print(f"  {where[:58]:<58}{ncalls / num_steps:>11.1f}{tottime / num_steps * 1e6:>9.1f}")
    if trace_dir:
        prof.export_chrome_trace(f"{trace_dir}/trace_{name.split()[0]}.json")


def _print_top(title: str, events: list[Any], microseconds: Callable[[Any], float], count: int,
               num_steps: int) -> None:
    """The `count` event names with the most time, per step."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        entry = totals[e.name]
        entry[0] += 1
        entry[1] += microseconds(e)
    print(f"  {title:<58}{'calls/step':>11}{'us/step':>9}")
    for op, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:count]:
        print(f"  {op[:58]:<58}{calls / num_steps:>11.1f}{us / num_steps:>9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HuggingFace-format directory (default: the embedded model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer", type=int, default=None, help="layer to trace (default: the middle one)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs for any step (separates the cost of eager steps from that of tracing)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="keep the prefix cache on; off by default because every repeat sends the same prompts, so "
                         "untraced requests would skip their prefill from the cache while traced ones never read it")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="step ahead of the previous readback (default: the engine's, on for CUDA)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print the wall time of each engine phase and the steps by kind, per workload")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="torch.profiler over this many steady decode steps of each workload")
    ap.add_argument("--profile-dir", default=None, help="write each workload's chrome trace here")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling)
    hf_config = llm.engine.hf_config
    layer = args.layer if args.layer is not None else hf_config.num_hidden_layers // 2
    site = f"model.layers.{layer}"
    prompts = workload(args.num_prompts, 0, llm.engine.runner.head.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vector = torch.randn(hf_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.1
    workloads: dict[str, Callable[[], list[dict[str, Any] | None]]] = {
        "untraced": lambda: [None] * len(prompts),
        f"save {site}.output": lambda: [{"trace": TracePlan([Save(site=site)])} for _ in prompts],
        f"add vector at {site}.output": lambda: [{"trace": TracePlan([Add(site=site, value=vector)])} for _ in prompts],
    }
    clock = PhaseClock() if args.breakdown else None
    if clock is not None:
        clock.install(llm)
    # Warm-up: one full pass of each workload compiles every kernel variant its prefill shapes need (Triton
    # compiles on first use: seconds on a fresh machine) and captures the decode graphs with its taps, so no
    # measured repeat pays for either.
    for make in workloads.values():
        timed(llm, prompts, params, make)
    results: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.repeats):
        for name, make in workloads.items():
            with clock.measure(name) if clock is not None else contextlib.nullcontext():
                results[name].append(timed(llm, prompts, params, make))
    medians = {name: statistics.median(values) for name, values in results.items()}
    # The ratio to untraced is taken within each repeat (the workloads run back to back there), then the
    # median over repeats: the device machine's speed drifts by 10-20% between runs, far less within one.
    ratios = {name: [v / u for v, u in zip(values, results["untraced"])] for name, values in results.items()}
    device = torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"\nworkload: {args.num_prompts} prompts of 32-128 tokens, {args.output_len} output tokens each, greedy; "
          f"model {llm.engine.model_name} ({llm.engine.dtype}); {device}; median of {args.repeats}"
          f"{'; enforce_eager' if args.enforce_eager else ''}"
          f"; prefix caching {'on' if args.enable_prefix_caching else 'off'}"
          f"; async scheduling {'on' if llm.engine.async_scheduling else 'off'}")
    print(f"{'workload':<40}{'output tok/s':>14}{'vs untraced':>13}   per repeat")
    for name, value in medians.items():
        per_repeat = " ".join(f"{r:.2f}" for r in ratios[name])
        print(f"{name:<40}{value:>14.1f}{statistics.median(ratios[name]):>13.2f}   {per_repeat}")
    graphs = llm.engine.runner.cuda_graphs
    if graphs is not None:
        print(f"CUDA graph replays: {graphs.num_replays}, of which with tracing taps: {graphs.num_tap_replays}")
    if clock is not None:
        clock.report()
    if args.profile_steps:
        for name, make in workloads.items():
            profile_decode_steps(llm, prompts, name, make(), args.profile_steps, args.profile_dir)


if __name__ == "__main__":
    main()
