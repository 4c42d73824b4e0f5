"""The "none" head: no LM head at all, for embedding checkpoints that ship none (Qwen3-Embedding-8B: an untied
config, no `lm_head.weight`) or for serving a generative model's embeddings only (`--head none`).

Such an engine serves only requests whose sampled token nobody reads (a request feature that declares
`discards_tokens`, as embedding requests do); the engine and its frontends refuse every other request by
name. Each row "samples" token 0 without computing logits, and anything that asks for logits (logprobs, a
trace of the `logits` site) fails with an error instead of reading made-up values.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.heads.base import LMHead
from pellucid.runner.sampling_metadata import SamplerOutput, SamplingMetadata


class NoHead(LMHead):
    name = "none"
    supports_tensor_parallel = True
    computes_logits = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this engine has no LM head (an embedding model, or --head none): it computes no logits")

    def model_dtype_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def sample(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        return SamplerOutput(sampled_token_ids=torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size}
