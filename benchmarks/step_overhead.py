"""CPU time per engine step at a large decode batch, with the model forward stubbed out.

Measures what the engine spends on the host each step (schedule, batch build, sampling metadata,
LM head + sampler call overhead on a tiny vocabulary, output processing and detokenization) so it
can be compared with the GPU time of a step. Runs on the CPU; no GPU needed.

    python benchmarks/step_overhead.py --batch 256 --steps 200
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch


class StubModel(torch.nn.Module):
    """Returns rows of a fixed random tensor: no compute, so the step is host overhead only."""

    def __init__(self, inner: torch.nn.Module, max_tokens: int) -> None:
        super().__init__()
        self.inner = inner
        self.hidden = torch.randn(max_tokens, inner.config.hidden_size, dtype=next(inner.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]


def build_engine(batch: int, prompt_len: int, output_len: int):
    from pellucid.config import EngineConfig
    from pellucid.engine.engine_core import EngineCore
    from pellucid.sampling_params import SamplingParams
    from pellucid.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen3", tempfile.mkdtemp(prefix="step-overhead-"), max_position_embeddings=4096)
    max_len = prompt_len + output_len + 8
    config = EngineConfig.from_kwargs(model_dir, device="cpu", max_num_seqs=batch, max_model_len=max_len,
                                      max_num_batched_tokens=max(batch * prompt_len, 2048),
                                      num_kv_blocks=batch * (max_len // 16 + 2))
    core = EngineCore(config)
    core.runner.model = StubModel(core.runner.model, config.scheduler.max_num_batched_tokens)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = torch.randint(10, 500, (prompt_len,), generator=gen).tolist()
        core.add_request(f"r{i}", prompt, params)
    return core


class PhaseTimer:
    """Wraps named bound methods to add up the time spent in each, per phase of the step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, owner: object, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t0
        setattr(owner, method, timed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="print the top functions by cumulative time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    core = build_engine(args.batch, args.prompt_len, args.steps + 20)
    # Prefill every request first; then time decode steps only.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.num_waiting:
        core.step()
    for _ in range(10):
        core.step()
    assert core.scheduler.num_running == args.batch, f"only {core.scheduler.num_running} requests running"
    phases = PhaseTimer()
    phases.wrap(core.scheduler, "schedule", "schedule")
    phases.wrap(core.runner, "execute", "runner.execute (batch build, metadata, head, sampler, readback)")
    phases.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    phases.wrap(core.outputs, "process_tokens", "outputs.process_tokens (detokenize, stops)")
    phases.wrap(core.outputs, "make_outputs", "outputs.make_outputs")
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        if profiler:
            profiler.enable()
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
        if profiler:
            profiler.disable()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    median = statistics.median(times) * 1e3
    print("| phase | mean ms/step |\n| --- | --- |")
    for phase, total in phases.totals.items():
        print(f"| {phase} | {total / args.steps * 1e3:.3f} |")
    print(f"| whole step (mean) | {sum(times) / len(times) * 1e3:.3f} |\n")
    print(f"| workload | figure | target |\n| --- | --- | --- |\n"
          f"| decode step, batch {args.batch}, context ~{args.prompt_len}, forward stubbed (CPU) | "
          f"{median:.3f} ms/step median (p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.3f}) | <= 1 ms |")


if __name__ == "__main__":
    main()
