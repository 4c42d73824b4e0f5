"""Embedding requests: the frontends' half of `LLM.embed` and `/v1/embeddings`.

An embedding request is an ordinary request that samples one greedy token, which is dropped, and carries
the pooling feature (pooling/feature.py). With last-token pooling the feature hands back the hidden state
of the row the request samples from (the backbone's final-normed output at the last prompt position: the
LM head's input), so the request reads the prefix cache like any other, and embeddings of prompts that
share a prefix (an instruction) share its KV. Mean and first-token pooling read positions the head never
sees: their requests also carry a trace that saves the backbone's output (the site `model`, or a stage's
backbone) there, and compute every prompt position.

The pooling itself (mean or pick, truncation, L2 normalisation) runs here, in float32, on the saved rows.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.pooling.config import PoolerConfig, PoolingParams
from pellucid.pooling.feature import POOL_KEY, POOLED_HIDDEN
from pellucid.sampling_params import SamplingParams
from pellucid.tracing.ops import Save
from pellucid.tracing.plan import TRACE_KEY, TracePlan

POOL_SAVE = "pool.hidden"
# The one sampled token is dropped: greedy and not detokenized, so it costs the head's one row only.
EMBED_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
_TRACED_POSITIONS = {"cls": [0], "mean": None}      # what the traced poolings save (None: every prompt position)


class Embedder:
    """One model's pooler, and what turns prompts into embedding requests and their outputs into vectors."""

    def __init__(self, pooler: PoolerConfig, info: Any) -> None:
        self.pooler = pooler
        self.hidden_size = int(info.hidden_size)
        self.max_model_len = int(info.max_model_len)
        # Last-token pooling reads the LM head's input rows (pooling/feature.py); the others trace the backbone.
        self.plan = None if pooler.pooling_type == "last" else TracePlan(
            [Save(site=info.backbone, name=POOL_SAVE, positions=_TRACED_POSITIONS[pooler.pooling_type], phase="prompt")])

    @classmethod
    def for_engine(cls, info: Any, override: dict[str, Any] | str | None = None) -> "Embedder":
        """The pooler of the engine's model directory (see PoolerConfig.for_model); ValueError when the model's
        pooler cannot be served."""
        from pellucid.models.loader import read_hf_config

        return cls(PoolerConfig.for_model(info.model, read_hf_config(info.model), override), info)

    def extras(self) -> dict[str, Any]:
        """Engine request extras of an embedding request: the pooling feature (pooling/feature.py), and for
        mean and first-token pooling the trace that saves the positions they read."""
        extras: dict[str, Any] = {POOL_KEY: self.pooler.pooling_type}
        if self.plan is not None:
            extras[TRACE_KEY] = self.plan
        return extras

    def check(self, params: PoolingParams) -> int:
        """The embedding size a request with these params gets; ValueError naming the problem."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
        return self.pooler.output_size(params.dimensions, self.hidden_size)

    def prompt_ids(self, ids: list[int], params: PoolingParams) -> list[int]:
        """The ids the engine embeds: the last `truncate_prompt_tokens` of them, fitting the engine."""
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens; an embedding input may have at most "
                             f"{self.max_model_len - 1} (max_model_len - 1): shorten it or set truncate_prompt_tokens")
        return ids

    def embeddings(self, outputs: list[Any], params: PoolingParams) -> torch.Tensor:
        """The float32 embeddings [len(outputs), size] of finished embedding requests, pooled, truncated and
        normalised together; RuntimeError naming the first that failed."""
        pooled = torch.stack([self._pooled(output) for output in outputs])[:, :self.check(params)]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(pooled, dim=1) if normalize else pooled

    def _pooled(self, output: Any) -> torch.Tensor:
        if output.error:
            raise RuntimeError(f"the embedding request {output.request_id} failed: {output.error}")
        if self.plan is None:
            row = output.extras.get(POOLED_HIDDEN)
            if row is None:
                raise RuntimeError(f"the embedding request {output.request_id} finished without its hidden state")
            return row.to(device="cpu", dtype=torch.float32)
        saves, positions = output.extras.get("saves") or {}, output.extras.get("save_positions") or {}
        num_prompt = len(output.prompt_token_ids)
        expected = [0] if self.pooler.pooling_type == "cls" else list(range(num_prompt))
        if POOL_SAVE not in saves or positions.get(POOL_SAVE) != expected:
            raise RuntimeError(f"the embedding request {output.request_id} finished with hidden states of positions "
                               f"{positions.get(POOL_SAVE)} where its pooling needs {expected}")
        rows = saves[POOL_SAVE].to(device="cpu", dtype=torch.float32)
        return rows.mean(dim=0) if self.pooler.pooling_type == "mean" else rows[0]
