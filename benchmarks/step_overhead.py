"""CPU time per engine step at a large decode batch, with the model forward stubbed out.

Measures what the engine spends on the host each step (schedule, batch build, sampling metadata,
sampler call overhead, output processing and detokenization) so it can be compared with the GPU time
of a step. The model forward and the LM head (device work on a GPU) are stubbed: they return fixed
rows, the logits over 16 token ids so that the sampler's vocabulary pass costs nothing either. Runs on
the CPU; no GPU needed.

    python benchmarks/step_overhead.py --batch 256 --steps 200

Two output modes are measured in the same run: `final` (requests added with stream=False, as
LLM.generate does: outputs only when a request finishes) and `stream` (AsyncLLM / the server: a
cumulative output every step). `--gpu-ms X` makes the stubbed step behave like an asynchronous device:
the forward returns at once and the sampled-token readback waits until X ms after the forward was
launched, so host work done between launch and readback is hidden, as it would be on a GPU.
`--async-scheduling` (the default here, as on CUDA) launches step N+1 before step N's outputs are
processed, so detokenization and output building run inside that window too; `--no-async-scheduling`
measures the serial step.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import tempfile
import time

import torch


class StubModel(torch.nn.Module):
    """Returns rows of a fixed random tensor: no compute, so the step is host overhead only. With
    `device_ms`, it records when the stand-in device work of this step would be done."""

    def __init__(self, inner: torch.nn.Module, max_tokens: int, device_ms: float) -> None:
        super().__init__()
        self.inner = inner
        self.hidden = torch.randn(max_tokens, inner.config.hidden_size, dtype=next(inner.parameters()).dtype)
        self.device_s = device_ms / 1e3
        self.done_at = 0.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.done_at = time.perf_counter() + self.device_s
        return self.hidden[: input_ids.shape[0]]


def build_engine(batch: int, prompt_len: int, output_len: int, stream: bool, device_ms: float,
                 async_scheduling: bool):
    from pellucid.config import EngineConfig
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams
    from pellucid.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen3", tempfile.mkdtemp(prefix="step-overhead-"), max_position_embeddings=4096)
    max_len = prompt_len + output_len + 8
    config = EngineConfig.from_kwargs(model_dir, device="cpu", max_num_seqs=batch, max_model_len=max_len,
                                      max_num_batched_tokens=max(batch * prompt_len, 2048),
                                      num_kv_blocks=batch * (max_len // 16 + 2), async_scheduling=async_scheduling)
    llm = LLM.from_config(config)
    core = llm.engine
    stub = StubModel(core.runner.model, config.scheduler.max_num_batched_tokens, device_ms)
    core.runner.model = stub
    # The LM head matmul and the sampler's pass over the vocabulary are device work on a GPU too: fixed
    # logits rows over 16 token ids, so the sampler call (metadata, dispatch) runs at no compute cost.
    logits = torch.randn(max(batch, 1), 16)
    core.runner.head.compute_logits = lambda hidden: logits[: hidden.shape[0]]
    if device_ms > 0:
        inner_readback = core.runner._device_readback

        @contextlib.contextmanager
        def readback_after_device():
            # The readback is where a GPU step blocks: wait for the stand-in device work to be done.
            delay = stub.done_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with inner_readback():
                yield
        core.runner._device_readback = readback_after_device
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = torch.randint(10, 500, (prompt_len,), generator=gen).tolist()
        llm.add_request(f"r{i}", prompt, params, stream=stream)
    return llm


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


def measure(args: argparse.Namespace, stream: bool) -> tuple[dict[str, float], list[float]]:
    llm = build_engine(args.batch, args.prompt_len, args.steps + 20, stream, args.gpu_ms, args.async_scheduling)
    core = llm.engine
    # Prefill every request first; then time decode steps only.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.num_waiting:
        llm.step()
    for _ in range(10):
        llm.step()
    assert core.scheduler.num_running == args.batch, f"only {core.scheduler.num_running} requests running"
    phases = PhaseTimer()
    phases.wrap(core.scheduler, "schedule", "schedule")
    phases.wrap(core.runner, "launch", "runner.launch (batch build, metadata, forward, head, sampler)")
    phases.wrap(core.runner, "collect", "runner.collect (readback wait, token dicts)")
    phases.wrap(core.runner.head, "sample", "  of which head.sample (logits stubbed; sampler launch)")
    phases.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    phases.wrap(core, "_output", "engine outputs (token ids per reported request)")
    phases.wrap(llm.output_processor, "process", "frontend output processor (detokenize, stops, RequestOutputs)")
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        if profiler:
            profiler.enable()
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
        if profiler:
            profiler.disable()
    if profiler:
        print(f"profile, {'stream' if stream else 'final'} mode:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {phase: total / args.steps * 1e3 for phase, total in phases.totals.items()}, times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="final,stream", help="comma-separated: final, stream")
    parser.add_argument("--gpu-ms", type=float, default=0.0,
                        help="stand-in device time per step, waited for at the token readback")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="launch step N+1 before processing step N's outputs (the CUDA default)")
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for mode in args.modes.split(","):
        if mode not in ("final", "stream"):
            raise SystemExit(f"unknown mode {mode!r}: use final or stream")
        results[mode] = measure(args, stream=mode == "stream")
    modes = list(results)
    print("| phase (mean ms/step) | " + " | ".join(modes) + " |\n| --- |" + " --- |" * len(modes))
    for phase in results[modes[0]][0]:
        print(f"| {phase} | " + " | ".join(f"{results[m][0].get(phase, 0.0):.3f}" for m in modes) + " |")
    print("| whole step (mean) | " + " | ".join(f"{statistics.mean(results[m][1]) * 1e3:.3f}" for m in modes) + " |\n")
    device = f", stand-in device {args.gpu_ms:g} ms/step" if args.gpu_ms else ", forward stubbed"
    device += ", async scheduling" if args.async_scheduling else ", serial"
    print("| workload | mode | figure | target |\n| --- | --- | --- | --- |")
    for m in modes:
        times = sorted(results[m][1])
        print(f"| decode step, batch {args.batch}, context ~{args.prompt_len}{device} (CPU) | {m} | "
              f"{statistics.median(times) * 1e3:.3f} ms/step median (p90 {times[int(0.9 * len(times))] * 1e3:.3f}) | "
              f"{'<= 1 ms host' if not args.gpu_ms else f'{args.gpu_ms:g} ms = all host work hidden'} |")


if __name__ == "__main__":
    main()
