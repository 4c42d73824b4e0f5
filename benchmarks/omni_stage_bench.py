"""Qwen3-Omni's per-frame parts alone on the GPU: the talker's code predictor (its CUDA graphs and its eager
loop) and code2wav's window decode, at Qwen3-Omni-30B-A3B shapes with random bf16 weights.

    python3 benchmarks/omni_stage_bench.py [--rows 1,8,32] [--windows 1x30,1x50,8x50]

For each row count: milliseconds per frame of rows (median of CUDA-event timed calls) and the kernels one
call launches (torch.profiler), for the code predictor's graph replay and its eager loop, greedy and
sampling. For each code2wav window shape (batch x frames): milliseconds per decode and its kernels. The
reference in the same run is the weight-bytes floor at the copy bandwidth measured here: what a frame's
code predictor must read (num_code_groups - 1 passes over its layers and one head each).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from omni_pipeline_bench import build_full  # noqa: E402
from pellucid.bench.floors import measure_floors, median_ms  # noqa: E402
from pellucid.models.loader import load_model  # noqa: E402
from pellucid.models.qwen3_omni.code_predictor_graphs import CodePredictorGraphs  # noqa: E402


def call_kernels(fn) -> list:
    """The CUDA kernels one call of fn launches (profiled after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "Memcpy" not in e.name and "Memset" not in e.name]


def kernels_per_call(fn) -> int:
    return len(call_kernels(fn))


def print_top_kernels(fn, top: int = 8) -> None:
    by_name: dict[str, list[float]] = {}
    for e in call_kernels(fn):
        entry = by_name.setdefault(e.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {us / 1e3:8.3f} ms {n:5d}x  {name}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--windows", default="1x30,1x50,8x50", help="code2wav windows, batch x frames")
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    model_dir = build_full(tempfile.mkdtemp(prefix="omni-stage-"), 1)
    floors = measure_floors()
    print(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {floors.copy_bytes_per_s / 1e12:.2f} TB/s")

    bench_code_predictor(model_dir, dtype, device, floors, [int(r) for r in args.rows.split(",")])
    torch.cuda.empty_cache()
    bench_code2wav(model_dir, dtype, device, args.windows.split(","))
    return 0


def bench_code_predictor(model_dir: str, dtype: torch.dtype, device: torch.device, floors, rows_list: list[int]) -> None:
    talker, _ = load_model(model_dir, dtype, device, max_model_len=4096, submodel="talker")
    predictor = talker.talker.code_predictor
    groups = predictor.num_code_groups - 1
    layer_bytes = sum(p.numel() * p.element_size() for p in predictor.model.layers.parameters())
    head_bytes = predictor.lm_head[0].weight.numel() * predictor.lm_head[0].weight.element_size()
    floor_ms = floors.bytes_time(groups * (layer_bytes + head_bytes)) * 1e3
    graphs = CodePredictorGraphs(predictor, rows_list, dtype, device)
    graphs.capture()
    hidden_size = int(predictor.config.hidden_size)
    print("| part | rows | mode | ms per call | kernels per call | floor ms (weight bytes) | call / floor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for rows in rows_list:
            hidden = torch.randn(rows, hidden_size, device=device, dtype=dtype)
            first = torch.randn(rows, hidden_size, device=device, dtype=dtype)
            for sampling in (False, True):
                greedy = torch.zeros(rows, dtype=torch.bool, device=device) if sampling else None
                for how, call in (("graph", lambda: graphs.predict(hidden, first, greedy, {})),
                                  ("eager", lambda: predictor.predict(hidden, first, greedy, {}))):
                    ms = median_ms(call, 30)
                    print(f"| code predictor | {rows} | {how}, {'sampling' if sampling else 'greedy'} | {ms:.3f} | "
                          f"{kernels_per_call(call)} | {floor_ms:.3f} | {ms / floor_ms:.1f}x |", flush=True)
        print("the code predictor's top kernels, one graph replay of 1 row, sampling:")
        hidden = torch.randn(1, hidden_size, device=device, dtype=dtype)
        greedy = torch.zeros(1, dtype=torch.bool, device=device)
        print_top_kernels(lambda: graphs.predict(hidden, hidden, greedy, {}), top=12)


def bench_code2wav(model_dir: str, dtype: torch.dtype, device: torch.device, windows: list[str]) -> None:
    code2wav, _ = load_model(model_dir, dtype, device, submodel="code2wav")
    decoder = code2wav.code2wav
    top_windows = []
    with torch.inference_mode():
        for shape in windows:
            batch, frames = (int(v) for v in shape.split("x"))
            codes = torch.randint(0, decoder.codebook_size, (batch, decoder.num_quantizers, frames), device=device)
            call = (lambda c: lambda: decoder(c))(codes)
            for tuned in (False, True):
                with torch.backends.cudnn.flags(enabled=True, benchmark=tuned):
                    ms = median_ms(call, 10)
                    print(f"| code2wav window | {batch} x {frames} frames | eager{', cuDNN autotuned' if tuned else ''} | "
                          f"{ms:.3f} | {kernels_per_call(call)} | - | - |", flush=True)
            top_windows.append(call)
    print("code2wav's top kernels and convolutions (device ms, input shapes), default cuDNN, the last window shape:")
    with torch.inference_mode():
        print_top_kernels(top_windows[-1])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            top_windows[-1]()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages(group_by_input_shape=True) if "conv" in e.key]
        for e in sorted(rows, key=lambda e: -e.device_time_total)[:8]:
            print(f"    {e.device_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key} {e.input_shapes[:2]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
