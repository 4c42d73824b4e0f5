"""Request outputs, shaped like vLLM's (RequestOutput.outputs[i].text / token_ids / logprobs / finish_reason)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int                     # 1-based rank of this token under the distribution
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None      # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None                  # set when the request ended with an error
    bad_request: bool = False                 # that error is the request's own (its constraints contradict)
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # saved activations, hidden states, ...


@dataclass
class EmbeddingOutput:
    """One embedding: `data`, a float32 tensor [size], pooled (and normalised) as the model's pooler says;
    `embedding`, the same values as a list (vLLM's field), made when first read."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        if self._list is None:
            self._list = self.data.tolist()
        return self._list

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[0])

    def __post_init__(self) -> None:
        self._list: list[float] | None = None


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt, shaped like vLLM's (output.outputs.embedding)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """One sequence's classification: `probs`, the class probabilities (softmax over the classes; the sigmoid
    of the one logit of a one-label model, as vLLM's `classify` gives them); `logits`, the head's raw output
    (a reward model's reward)."""

    probs: list[float]
    logits: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result per prompt, shaped like vLLM's (output.outputs.probs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per pair, shaped like vLLM's (output.outputs.score)."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True
