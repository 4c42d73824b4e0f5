"""Ways to bring a traced batch's saves to the host, each save its own CPU tensor.

    python3 benchmarks/save_copy_bench.py [--saves 64] [--rows 144] [--hidden 2048] [--repeats 7]

When traced requests finish, their saves are gathered into one device tensor and handed out as CPU tensors
that share memory with nothing else (safetensors refuses shared storage). This times the candidate copies
on one gathered bf16 tensor of `--saves` x `--rows` rows, the way an application calls them: each call's
results stay alive until the next call's are returned. Median ms per call over the repeats (the first call
of each way excluded), interleaved, against one device-to-host copy of the same bytes into memory pinned
before the timing (the transfer alone).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

Strategy = Callable[[torch.Tensor, list[int]], list[torch.Tensor]]


def pinned_per_save(gathered: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for n in counts:
        host = torch.empty((n, *gathered.shape[1:]), dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered[offset:offset + n], non_blocking=True)
        out.append(host)
        offset += n
    torch.cuda.current_stream().synchronize()
    return out


class StagedPageable:
    """One pinned buffer kept across calls: one copy in, a sync, then one pageable copy per save."""

    def __init__(self) -> None:
        self.staging = torch.empty(0, dtype=torch.uint8, pin_memory=True)

    def __call__(self, gathered: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        nbytes = gathered.numel() * gathered.element_size()
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(max(nbytes, 2 * self.staging.numel()), dtype=torch.uint8, pin_memory=True)
        host = self.staging[:nbytes].view(gathered.dtype).view(gathered.shape)
        host.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return [part.clone() for part in host.split(counts)]


def pageable_per_save(gathered: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return [part.to("cpu") for part in gathered.split(counts)]


def one_pageable_then_clone(gathered: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return [part.clone() for part in gathered.cpu().split(counts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=64)
    parser.add_argument("--rows", type=int, default=144, help="mean rows per save (they vary +-40%%)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(int(args.rows * 0.6), int(args.rows * 1.4) + 1, (args.saves,), generator=g).tolist()
    gathered = torch.randn(sum(counts), args.hidden, device="cuda").to(torch.bfloat16)
    nbytes = gathered.numel() * gathered.element_size()
    strategies: dict[str, Strategy] = {
        "pinned tensor per save (current)": pinned_per_save,
        "pinned staging kept + pageable clone per save": StagedPageable(),
        "pageable .to('cpu') per save": pageable_per_save,
        "one pageable .cpu() + clone per save": one_pageable_then_clone,
    }
    kept: dict[str, list[torch.Tensor]] = {}
    times: dict[str, list[float]] = {name: [] for name in strategies}
    for _ in range(args.repeats):
        for name, fn in strategies.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = fn(gathered, counts)
            times[name].append(time.perf_counter() - t0)
            kept[name] = result          # the previous call's results die only now
            assert all(t.untyped_storage().data_ptr() != kept[name][0].untyped_storage().data_ptr()
                       for t in kept[name][1:])
    pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    transfer = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(gathered, non_blocking=True)
        torch.cuda.synchronize()
        transfer.append(time.perf_counter() - t0)
    ref = statistics.median(transfer[1:]) * 1e3
    print(f"{torch.cuda.get_device_name()}: {args.saves} saves, {nbytes / 1e6:.1f} MB; one copy into pinned "
          f"memory {ref:.2f} ms ({nbytes / ref / 1e6:.1f} GB/s)")
    print("| way | median ms | first call ms | vs the transfer alone |\n| --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts[1:]) * 1e3
        print(f"| {name} | {med:.2f} | {ts[0] * 1e3:.2f} | {med / ref:.2f}x |")


if __name__ == "__main__":
    main()
