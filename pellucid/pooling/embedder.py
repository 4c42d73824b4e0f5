"""Embedding requests: the frontends' half of `LLM.embed` and `/v1/embeddings`.

An embedding request is an ordinary request that samples one greedy token, which is dropped, and carries
the pooling feature (pooling/feature.py), which hands back the pooled hidden state (the backbone's
final-normed output: the last prompt position's, the first's, or the mean over the prompt). What is left
for the frontend (truncation, L2 normalisation) runs here, in float32.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.pooling.config import PoolerConfig, PoolingParams, fit_prompt
from pellucid.pooling.feature import POOL_KEY, POOLED_HIDDEN, finished_output
from pellucid.sampling_params import SamplingParams

# The one sampled token is dropped: greedy and not detokenized, so it costs the head's one row only.
EMBED_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


class Embedder:
    """One model's pooler, and what turns prompts into embedding requests and their outputs into vectors."""

    def __init__(self, pooler: PoolerConfig, info: Any) -> None:
        self.pooler = pooler
        self.hidden_size = int(info.hidden_size)
        self.max_model_len = int(info.max_model_len)

    @classmethod
    def for_engine(cls, info: Any, override: dict[str, Any] | str | None = None) -> "Embedder":
        """The pooler of the engine's model directory (see PoolerConfig.for_model); ValueError when the model's
        pooler cannot be served."""
        from pellucid.models.loader import read_hf_config

        return cls(PoolerConfig.for_model(info.model, read_hf_config(info.model, info.hf_overrides), override), info)

    def extras(self) -> dict[str, Any]:
        """Engine request extras of an embedding request."""
        return {POOL_KEY: self.pooler.pooling_type}

    def check(self, params: PoolingParams) -> int:
        """The embedding size a request with these params gets; ValueError naming the problem."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
        return self.pooler.output_size(params.dimensions, self.hidden_size)

    def prompt_ids(self, ids: list[int], params: PoolingParams) -> list[int]:
        """The ids the engine embeds: the last `truncate_prompt_tokens` of them, fitting the engine."""
        return fit_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)

    def embeddings(self, outputs: list[Any], params: PoolingParams) -> torch.Tensor:
        """The float32 embeddings [len(outputs), size] of finished embedding requests, pooled, truncated and
        normalised together; RuntimeError naming the first that failed."""
        pooled = torch.stack([finished_output(output, POOLED_HIDDEN, "embedding", "pooled hidden state")
                              for output in outputs])[:, :self.check(params)]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(pooled, dim=1) if normalize else pooled
