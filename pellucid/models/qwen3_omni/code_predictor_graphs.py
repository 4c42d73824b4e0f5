"""CUDA graphs of the code predictor's frame loop (CodePredictor.predict_codes).

A frame's other codebooks take num_code_groups - 1 passes of the code predictor, one after the other,
each a few dozen small kernels: eagerly, ~1,500 launches per talker step, which bound the talker's frame
rate. Their shapes depend on the row count alone (the KV cache holds num_code_groups positions), so one
graph per row count replays the whole loop. Row counts are the runner's decode graph sizes; a step with
R rows replays the smallest graph of >= R rows (padding rows compute on stale inputs, and nobody reads
them). Two graphs per size: all rows greedy, and some rows sampling, which also reads the rows' noise.

Inputs live in fixed buffers: the rows' hidden states and first-code embeddings, the greedy mask, and the
noise, drawn eagerly into its buffer before the replay (a seeded row's draws come from its own
generator, which a graph could not hold).
"""
from __future__ import annotations

import bisect

import torch

from pellucid.logger import get_logger
from pellucid.models.qwen3_omni.code_predictor import CodePredictor
from pellucid.runner.cuda_graphs import capturing

logger = get_logger(__name__)


class CodePredictorGraphs:
    def __init__(self, predictor: CodePredictor, row_counts: list[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.predictor = predictor
        self.sizes = sorted(set(row_counts))
        rows = self.sizes[-1]
        hidden = int(predictor.config.hidden_size)
        self._hidden = torch.zeros((rows, hidden), dtype=dtype, device=device)
        self._first = torch.zeros((rows, hidden), dtype=dtype, device=device)
        self._greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self._noise = torch.ones(predictor.noise_shape(rows), dtype=torch.float32, device=device)
        # (size, sampling) -> (graph, codes [size, G - 1] written by each replay)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_rows = 0          # rows served by replays

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            for sampling in (False, True):
                for _ in range(2):      # compile the Triton kernels and warm the allocator outside the capture
                    self._run(size, sampling)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, pool, stream):
                    codes = self._run(size, sampling)
                self._graphs[(size, sampling)] = (graph, codes)
        logger.info("captured CUDA graphs of the talker's code predictor for %s rows", self.sizes)

    def _run(self, size: int, sampling: bool) -> torch.Tensor:
        greedy = self._greedy[:size] if sampling else None
        noise = self._noise[:size] if sampling else None
        return self.predictor.predict_codes(self._hidden[:size], self._first[:size], greedy, noise)

    def predict(self, hidden: torch.Tensor, first_code_embeds: torch.Tensor, greedy: torch.Tensor | None,
                seeds: dict[int, int]) -> torch.Tensor | None:
        """CodePredictor.predict by a graph replay, or None when the rows exceed the largest graph. The
        result is a view of the graph's output: use it before the next replay."""
        rows = hidden.shape[0]
        index = bisect.bisect_left(self.sizes, rows)
        if index == len(self.sizes):
            return None
        size = self.sizes[index]
        self._hidden[:rows].copy_(hidden)
        self._first[:rows].copy_(first_code_embeds)
        sampling = greedy is not None
        if sampling:
            self._greedy[:rows].copy_(greedy)
            self.predictor.draw_noise(rows, hidden.device, seeds, out=self._noise[:rows])
        graph, codes = self._graphs[(size, sampling)]
        graph.replay()
        self.num_rows += rows
        return codes[:rows]
