"""The dense LM head: full-vocabulary logits, then the sampler."""
from __future__ import annotations

from typing import Any

import torch

from pellucid.heads.base import LMHead
from pellucid.runner.sampling_metadata import SamplerOutput, SamplingMetadata


class DenseHead(LMHead):
    name = "dense"
    supports_tensor_parallel = True

    def sample(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        return sampler(self.model_dtype_logits(hidden), sampling)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "hidden_size": self.weight.shape[1]}
