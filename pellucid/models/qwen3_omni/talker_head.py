"""The talker's LM head: a frame per sampling row.

The codec head's logits, with the codec ids transformers suppresses set to -inf (the top 1024 of the
vocabulary but the codec EOS), go through the engine's sampler (temperature, top-k/p, repetition
penalty) for the frame's first code; the code predictor then samples the frame's other codes from the
row's hidden state and that code. The frame's codes ride in SamplerOutput.extra_token_ids [R, G]; the
first column is the row's sampled token.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.heads.base import LMHead
from pellucid.models.qwen3_omni.code_predictor_graphs import CodePredictorGraphs
from pellucid.runner.sampling_metadata import SamplerOutput, SamplingMetadata


class TalkerHead(LMHead):
    name = "qwen3_omni_talker"

    def __init__(self, talker: Any, suppressed_ids: list[int]) -> None:
        super().__init__(talker.codec_head.weight, {})
        self.talker = talker
        device = talker.codec_head.weight.device
        self._suppressed = torch.tensor(suppressed_ids, dtype=torch.int64, device=device)
        self.graphs: CodePredictorGraphs | None = None
        self._eager_rows = 0

    def model_dtype_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().model_dtype_logits(hidden)
        return logits.index_fill_(1, self._suppressed, float("-inf"))

    def sample(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        out = sampler(self.model_dtype_logits(hidden), sampling)
        first = out.sampled_token_ids
        greedy = None if sampling.all_greedy else sampling.temperature == 0
        first_embeds = self.talker.model.codec_embedding(first)
        rest = None
        if self.graphs is not None:
            rest = self.graphs.predict(hidden, first_embeds, greedy, sampling.seeds)
        if rest is None:
            self._eager_rows += hidden.shape[0]
            rest = self.talker.code_predictor.predict(hidden, first_embeds, greedy, sampling.seeds)
        out.extra_token_ids = torch.cat((first[:, None], rest), dim=1)
        return out

    def capture_cuda_graphs(self, row_counts: list[int]) -> None:
        weight = self.talker.codec_head.weight
        self.graphs = CodePredictorGraphs(self.talker.code_predictor, row_counts, weight.dtype, weight.device)
        self.graphs.capture()

    def usage(self) -> dict[str, int]:
        """Rows (frames) whose other codebooks came from a CUDA graph replay of the code predictor, and rows
        it ran eagerly."""
        return {"code_predictor_graph": self.graphs.num_rows if self.graphs is not None else 0,
                "code_predictor_eager": self._eager_rows}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "suppressed": int(self._suppressed.numel()),
                "num_code_groups": int(self.talker.code_predictor.num_code_groups)}
