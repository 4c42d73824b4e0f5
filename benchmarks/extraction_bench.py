"""Extraction throughput (hidden states of 3 layers written to safetensors files) against plain prefill
of the same prompts, measured in the same run.

    python benchmarks/extraction_bench.py                                   # CPU: a small random Llama
    python benchmarks/extraction_bench.py --model Llama-3.1-8B --min-len 1024 --max-len 2048 \\
        --num-prompts 96 --out-root /tmp                                      # GPU: the issue's target shape

--profile adds one instrumented run per place (time in engine steps, saves finalize, staging, the writer
threads' writes and fsyncs, the tail after the last step) and --probe the raw speeds those stages are
bounded by (CPU stack, GPU stack + D2H into pinned / pageable memory, file writes with fsync on 1 and 4
threads). Put --model-cache on tmpfs (e.g. /dev/shm/models) when timing disk writes: a freshly built
16 GB checkpoint's writeback otherwise competes with the measured files.

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
    ap.add_argument("--profile", action="store_true",
                    help="after the table, time where an extraction run spends its time (engine steps, saves "
                         "finalize, staging, writer stages)")
    ap.add_argument("--probe", action="store_true",
                    help="also measure the raw speeds the stages are bounded by (D2H copy, file writes)")
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
    if args.profile:
        profile(prefill, extract, roots)
    if args.probe:
        probe_speeds(llm, prompts, layers, roots)


# ---- --profile: where an extraction run's time goes ------------------------------------------------
class _Timers:
    """Wall time per named stage, summed over threads (the writer thread's stages overlap the engine's)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self.lock = threading.Lock()

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self.lock:
                    entry = self.totals.setdefault(name, [0.0, 0])
                    entry[0] += time.perf_counter() - start
                    entry[1] += 1
        return timed

    def report(self, title: str, elapsed: float) -> None:
        print(f"  {title}: {elapsed * 1e3:.0f} ms wall")
        for name, (total, count) in self.totals.items():
            print(f"    {name:<58} {total * 1e3:9.1f} ms  x{count}")
        self.totals.clear()


def profile(prefill: Any, extract: Any, roots: list[str]) -> None:
    """Instrument (in this process only) the stages of an extraction run and time them."""
    import pellucid.extraction.staging as staging_module
    import pellucid.extraction.writer as writer_module
    from pellucid.engine.engine_core import EngineCore
    from pellucid.tracing.feature import EngineTracing

    timers = _Timers()
    patches = [(EngineTracing, "after_step", "finalize saves (gather, D2H, stream sync)"),
               (EngineCore, "step", "engine.step (main thread, includes finalize)"),
               (writer_module.DatasetWriter, "add", "writer.add (main thread, includes waiting for room)"),
               (staging_module.HostStager, "stage", "stage: queue GPU stack + D2H (main thread)"),
               (writer_module.SampleRecord, "stacked_hidden_states", "wait for the D2H copy / stack (writer threads)"),
               (writer_module, "safetensors_parts", "safetensors header + views (writer thread)"),
               (writer_module.DatasetWriter, "close", "writer.close (tail after the last step)"),
               (os, "write", "os.write (writer threads)"), (os, "fsync", "os.fsync (file, dir, manifest)"),
               (os, "replace", "os.replace (rename)")]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, timers.wrap(label, getattr(owner, name)))
    try:
        print("\n--profile: one run each, stages summed (writer-thread stages overlap engine.step)")
        start = time.perf_counter()
        rate = prefill()
        timers.report(f"plain prefill ({rate:,.0f} tok/s)", time.perf_counter() - start)
        for root in roots:
            start = time.perf_counter()
            rate = extract(root)
            timers.report(f"extraction to {root} ({rate:,.0f} tok/s)", time.perf_counter() - start)
        real_atomic_write = writer_module.atomic_write
        writer_module.atomic_write = lambda path, data, **kwargs: None     # everything but the file I/O
        try:
            start = time.perf_counter()
            rate = extract(roots[0])
            timers.report(f"extraction, file writes skipped ({rate:,.0f} tok/s)", time.perf_counter() - start)
        finally:
            writer_module.atomic_write = real_atomic_write
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def probe_speeds(llm: LLM, prompts: list[list[int]], layers: list[int], roots: list[str]) -> None:
    engine = llm.engine
    hidden, dtype = engine.hf_config.hidden_size, engine.dtype
    lengths = [len(p) for p in prompts]
    sample_bytes = [n * len(layers) * hidden * torch.empty((), dtype=dtype).element_size() for n in lengths]
    total_gb = sum(sample_bytes) / 1e9
    print(f"\nraw speeds, {len(lengths)} samples, {total_gb:.2f} GB (one sample ~{sample_bytes[0] / 1e6:.0f} MB)")
    t = lengths[0]
    cols = [torch.randn(t, hidden).to(dtype) for _ in layers]
    best = min(_seconds(lambda: torch.stack(cols, dim=1)) for _ in range(5))
    print(f"  torch.stack on CPU, one sample: {best * 1e3:.1f} ms ({sample_bytes[0] / best / 1e9:.1f} GB/s)")
    if engine.device.type == "cuda":
        dev = [c.to(engine.device) for c in cols]
        pinned = torch.empty((t, len(layers), hidden), dtype=dtype, pin_memory=True)
        pageable = torch.empty((t, len(layers), hidden), dtype=dtype)

        def d2h(out: torch.Tensor) -> None:
            out.copy_(torch.stack(dev, dim=1), non_blocking=out.is_pinned())
            torch.cuda.synchronize()
        for name, out in (("pinned", pinned), ("pageable", pageable)):
            d2h(out)
            best = min(_seconds(lambda: d2h(out)) for _ in range(5))
            print(f"  GPU stack + D2H into {name} memory, one sample: {best * 1e3:.2f} ms "
                  f"({sample_bytes[0] / best / 1e9:.1f} GB/s)")
        start = time.perf_counter()
        fresh = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sample_bytes[:8]]
        print(f"  fresh pinned allocations, 8 samples: {(time.perf_counter() - start) * 1e3:.1f} ms")
        del fresh
    payload = [memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy()) for n in sample_bytes]
    for root in roots:
        for threads, sync in ((1, True), (4, True)) if root == roots[0] else ((1, True),):
            out = tempfile.mkdtemp(prefix="extraction-probe-", dir=root)
            try:
                start = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda a: _write_file(os.path.join(out, f"f{a[0]}"), a[1], sync),
                                  enumerate(payload)))
                elapsed = time.perf_counter() - start
            finally:
                shutil.rmtree(out, ignore_errors=True)
            print(f"  write files to {root}, {threads} thread(s), fsync {'on' if sync else 'off'}: "
                  f"{elapsed * 1e3:.0f} ms ({total_gb / elapsed:.2f} GB/s)")
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[:3] for line in f]
        for root in roots:
            best = max((m for m in mounts if root.startswith(m[1])), key=lambda m: len(m[1]), default=None)
            print(f"  {root}: mounted from {best}")
    except OSError:
        pass


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _write_file(path: str, data: memoryview, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
