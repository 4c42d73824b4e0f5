"""The two physical ceilings of the GPU, measured in the same run as the benchmark they bound.

Copy bandwidth counts bytes read plus bytes written of a large device-to-device copy; the matmul rate
is a large bf16 product on random data. Each is the median of several event-timed repetitions.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass
class Floors:
    device_name: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def bytes_time(self, num_bytes: float) -> float:
        return num_bytes / self.copy_bytes_per_s

    def flops_time(self, flops: float) -> float:
        return flops / self.matmul_flops_per_s


def median_ms(fn, repeats: int) -> float:
    """Median CUDA-event milliseconds of `repeats` calls of fn, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_floors(copy_gib: float = 2.0, matmul_n: int = 8192) -> Floors:
    if not torch.cuda.is_available():
        raise RuntimeError("measuring GPU floors needs CUDA")
    n = int(copy_gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 10)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    mm_ms = median_ms(lambda: a @ b, 10)
    del a, b
    torch.cuda.empty_cache()
    return Floors(device_name=torch.cuda.get_device_name(),
                  copy_bytes_per_s=2 * n * 2 / (copy_ms * 1e-3),
                  matmul_flops_per_s=2 * matmul_n ** 3 / (mm_ms * 1e-3))


def print_floors(floors: Floors) -> None:
    print(f"| device | copy bandwidth (read + write) | bf16 matmul rate |\n| --- | --- | --- |\n"
          f"| {floors.device_name} | {floors.copy_bytes_per_s / 1e12:.2f} TB/s | "
          f"{floors.matmul_flops_per_s / 1e12:.0f} TFLOP/s |")
