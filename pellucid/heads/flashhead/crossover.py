"""The batch size up to which FlashHead beats the dense head, measured at startup on the head's own shapes.

Stage 2 reads p * S rows of the head per row of the batch (rows rarely share clusters), so its traffic
grows with the batch while the dense head reads the whole matrix once: above some batch size the dense
head is faster. Where that happens depends on V, H, C, S, p and the GPU, so it is timed, not assumed:
greedy FlashHead against dense logits + argmax at batch 1, 2, 4, ... until the dense head wins (GPU time of CUDA-graph replays).

Under tensor parallelism every rank times the same ladder at the same time (both heads hold collectives),
and `agree` makes each rung's decision one for all ranks: the slowest rank's times, which a step waits for.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_cuda_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured as a CUDA graph, after one run on a side stream (as torch asks before a capture, so
    lazy allocations and autotuning happen outside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_us(fn: Callable[[], object], replays: int = 10, groups: int = 5) -> float:
    """GPU microseconds per call: median over `groups` of the mean of `replays` CUDA-graph replays. GPU
    time, not eager time: in a decode step the head's launches overlap the model's forward still running
    on the GPU, so what the step pays is the head's GPU time (eager timing at batch 1 measures launches)."""
    for _ in range(3):      # compiles the kernels for this shape
        fn()
    graph = capture_cuda_graph(fn)
    graph.replay()
    samples = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / replays)
    del graph
    return statistics.median(samples)


def measure_max_fast_batch(dense: Callable[[torch.Tensor], object], flash: Callable[[torch.Tensor], object],
                           hidden_size: int, dtype: torch.dtype, device: torch.device,
                           ladder: tuple[int, ...] = LADDER,
                           agree: Callable[[float, float], tuple[float, float]] | None = None,
                           ) -> tuple[int, list[tuple[int, float, float]]]:
    """(largest ladder batch at which FlashHead is no slower than dense at it and every smaller ladder
    batch, or 0 if it loses at batch 1; the (batch, dense us, flash us) rows timed). `agree(dense us,
    flash us)`: the times every rank decides on (tensor parallelism), so that all stop at the same rung."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    max_fast, table = 0, []
    with torch.inference_mode():
        for batch in ladder:
            hidden = torch.randn(batch, hidden_size, generator=generator).to(device, dtype)
            dense_us = time_us(lambda: dense(hidden))
            flash_us = time_us(lambda: flash(hidden))
            if agree is not None:
                dense_us, flash_us = agree(dense_us, flash_us)
            table.append((batch, dense_us, flash_us))
            if flash_us > dense_us:
                break
            max_fast = batch
    return max_fast, table
