"""Classification requests: the frontends' half of `LLM.classify`, `/classify`, and of `LLM.score`, `/score`
and `/rerank` for a cross-encoder (a one-label classifier scoring a text pair).

A classification request is an ordinary request that samples one greedy token, which is dropped, and carries
the pooling feature with kind "classify" (pooling/feature.py), which hands back the class logits of its
last prompt position (models/sequence_classification.py). The probabilities are vLLM's: a softmax over the
classes, or the sigmoid of a one-label model's logit.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.pooling.config import PoolingParams, fit_prompt
from pellucid.pooling.feature import CLASS_LOGITS, CLASSIFY, POOL_KEY, finished_output


class Classifier:
    """One sequence-classification model's labels, and what turns prompts into classification requests and
    their outputs into probabilities."""

    def __init__(self, info: Any, id2label: dict[int, str] | None = None) -> None:
        if not info.num_labels:
            raise ValueError(f"{info.model} is not a classification model (its architecture {info.architecture} has "
                             f"no classification head); classify and cross-encoder scores need a "
                             f"*ForSequenceClassification checkpoint")
        self.num_labels = int(info.num_labels)
        self.max_model_len = int(info.max_model_len)
        self.labels = [str((id2label or {}).get(i, f"LABEL_{i}")) for i in range(self.num_labels)]

    @classmethod
    def for_engine(cls, info: Any) -> "Classifier":
        """The classifier of the engine's model (its labels from config.json's id2label); ValueError when the
        model has no classification head."""
        from pellucid.models.loader import read_hf_config

        config = read_hf_config(info.model, info.hf_overrides) if info.num_labels else None
        return cls(info, getattr(config, "id2label", None))

    @staticmethod
    def extras() -> dict[str, Any]:
        """Engine request extras of a classification request."""
        return {POOL_KEY: CLASSIFY}

    def prompt_ids(self, ids: list[int], params: PoolingParams | None) -> list[int]:
        """The ids the engine classifies; ValueError for pooling params a classification does not take."""
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
        if params.dimensions is not None or params.normalize is not None:
            raise ValueError("dimensions and normalize are for embeddings; a classification takes "
                             "truncate_prompt_tokens only")
        return fit_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)

    def logits(self, outputs: list[Any]) -> torch.Tensor:
        """float32 [len(outputs), num_labels]: the class logits of finished classification requests;
        RuntimeError naming the first that failed."""
        return torch.stack([finished_output(output, CLASS_LOGITS, "classification", "class logits")
                            for output in outputs])

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)

    def check_cross_encoder(self) -> None:
        """A pair's score is the probability of a one-label model (a cross-encoder); ValueError for another."""
        if self.num_labels != 1:
            raise ValueError(f"scoring text pairs needs an embedding model or a cross-encoder (a classifier with "
                             f"one label); this classifier has {self.num_labels} labels: use classify")


def pair_ids(tokenizer: Any, first: str, second: str) -> list[int]:
    """A cross-encoder's input for a text pair: the tokenizer's pair encoding (its template's separators, or
    the two texts' tokens one after the other when it has none), as transformers and vLLM encode pairs."""
    return list(tokenizer(first, text_pair=second)["input_ids"])
